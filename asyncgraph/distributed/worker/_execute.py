"""Run one task's Function method: a backward, or a forward whose ctx goes back to the client."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from asyncgraph import Variable, no_grad
from asyncgraph.distributed.wire._fields import to_map
from asyncgraph.distributed.wire._payload import (
    BackwardTask,
    ForwardResult,
    ForwardTask,
    backward_result,
    ctx_from_state,
    ctx_state,
    read_payload,
)
from asyncgraph.distributed.wire._schema import TaskMessage
from asyncgraph.distributed.worker._registry import RegisteredFunction

__all__ = ["Threads", "execute"]


class Threads:
    """Runs synchronous Function methods in worker threads, at most ``limit`` at once.

    A thread cannot be stopped: when its task is cancelled (deadline, client cancel,
    drain), the task ends at once and the call is *abandoned*: it runs on in its
    thread, counted in ``abandoned`` until it really returns (``on_abandoned`` is
    called when a call is abandoned, ``on_ended`` when it returns). The thread tells
    the event loop without waiting for it: the loop may have stopped meanwhile (the
    worker exited, a test ended), and a thread waiting for a stopped loop would hold
    the process at exit forever.
    """

    def __init__(
        self,
        limit: int,
        *,
        on_abandoned: Callable[[], None] = lambda: None,
        on_ended: Callable[[], None] = lambda: None,
    ) -> None:
        self.limiter = anyio.CapacityLimiter(limit)
        self.abandoned = 0
        self.on_abandoned = on_abandoned  # a call was abandoned
        self.on_ended = on_ended  # an abandoned call returned

    async def run(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        soon = _call_soon_threadsafe()  # this call's loop (a Threads may outlive one)
        lock = threading.Lock()
        # started: the thread began the call; skip: cancelled before it began (then it
        # must not begin); abandoned: cancelled while it ran (counted until it returns).
        state = {"started": False, "finished": False, "skip": False, "abandoned": False}

        def in_thread() -> Any:
            with lock:
                if state["skip"]:
                    return None
                state["started"] = True
            try:
                with no_grad():  # grad mode is a contextvar: set it in the thread too
                    return method(*args, **kwargs)
            finally:
                with lock:
                    state["finished"] = True
                    abandoned = state["abandoned"]
                if abandoned:
                    try:
                        soon(self._ended)
                    except RuntimeError:  # the event loop is closed: the process is exiting
                        pass

        try:
            return await anyio.to_thread.run_sync(
                in_thread, limiter=self.limiter, abandon_on_cancel=True
            )
        except anyio.get_cancelled_exc_class():
            left_running = False
            with lock:
                if not state["started"]:
                    state["skip"] = True
                elif not state["finished"]:
                    state["abandoned"] = True
                    self.abandoned += 1
                    left_running = True
            if left_running:
                self.on_abandoned()
            raise

    def _ended(self) -> None:
        self.abandoned -= 1
        self.on_ended()


def _call_soon_threadsafe() -> Callable[[Callable[[], object]], object]:
    """This event loop's "run this callback soon", callable from any thread, never waiting.

    A per-loop branch kept for correctness, not speed (listed in the architecture
    guide): anyio's public ``from_thread.run_sync`` waits for the callback to have run,
    and anyio has no non-waiting form for users, so this asks the loop anyio names in
    its public token: asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``. A
    closed loop raises RuntimeError (trio's ``RunFinishedError`` is one).
    """
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return native.call_soon_threadsafe
    return native.run_sync_soon  # type: ignore[attr-defined,no-any-return]  # trio's TrioToken


async def execute(registered: RegisteredFunction, message: TaskMessage, threads: Threads) -> Any:
    """The task's result as it travels (the caller catches what the Function raises)."""
    fn = registered.function
    if message.op == "backward":
        task = read_payload(BackwardTask, message.payload, "p")
        ctx = ctx_from_state(task.ctx, fn)
        with no_grad():
            result = await _call(threads, registered.async_backward, fn.backward, ctx, *task.grads)
        return backward_result(result)
    forward = read_payload(ForwardTask, message.payload, "p")
    # As in-process: each input's requires_grad (read from its entry) in the ctx, and
    # whether the client records the node.
    application = fn.application(forward.args, forward.kwargs, recorded=any(forward.needs))

    def call(method: Any, *args: Any, **kwargs: Any) -> Any:
        return _call(threads, _is_async(method), method, *args, **kwargs)

    with no_grad():
        output = await application.run_forward(call)
    ctx = application.ctx
    if ctx.marked_dirty:
        raise TypeError(
            f"{fn.__name__}.forward called ctx.mark_dirty(...) on a worker, where it works on "
            f"copies of the inputs: the caller's Variables cannot change in place. Return "
            f"new Variables instead, or give {fn.__name__} dispatch = 'local'"
        )
    is_tuple = isinstance(output, tuple)
    outputs = output if is_tuple else (output,)
    non_diff = ctx.marked_non_differentiable
    result = ForwardResult(
        outputs,
        is_tuple,
        ctx_state(ctx, fn),
        tuple(i for i, o in enumerate(outputs) if any(o is n for n in non_diff)),
        # Raw values forward returned (not Variables): the client records them as raw
        # too, so that they get no materialized zero (as in-process).
        tuple(i for i, o in enumerate(outputs) if not isinstance(o, Variable)),
    )
    return to_map(result)


_is_async = inspect.iscoroutinefunction


async def _call(threads: Threads, is_async: bool, method: Any, *args: Any, **kwargs: Any) -> Any:
    """Await an async method (``is_async``); run a synchronous one in a worker thread.

    On a worker every synchronous method goes to a thread, whatever ``blocking``
    says: a remote function is slow by nature, and one that held the event loop
    would stall lease renewals (its task would be reclaimed and run twice),
    heartbeats, cancellations and every other task of the batch.
    """
    if is_async:
        return await method(*args, **kwargs)
    return await threads.run(method, *args, **kwargs)
