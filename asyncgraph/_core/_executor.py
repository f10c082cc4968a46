from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from asyncgraph._core._graph import Node
    from asyncgraph._core._variable import Variable

__all__ = [
    "BatchingExecutor",
    "Executor",
    "ForwardExecutor",
    "current_executor",
    "current_forward_executor",
    "remote_forwards",
    "use_executor",
]


@runtime_checkable
class Executor(Protocol):
    """Runs one node's backward.

    ``inline(node)``: True when the engine may call the node's (synchronous,
    cheap) backward itself, in the task that made it ready; no task is created.
    ``run_backward(node, grad_outputs)``: run it (async, threaded, remote...)
    and return what the Function's backward returned: one gradient or a tuple,
    one per forward input. Raising fails the pass; the engine names the node.

    Example::

        class Threaded:  # runs every (synchronous) backward in a worker thread
            def inline(self, node):
                return False

            async def run_backward(self, node, grad_outputs):
                return await anyio.to_thread.run_sync(
                    lambda: node.function.backward(node.ctx, *grad_outputs)
                )

        await loss.backward(executor=Threaded())
    """

    def inline(self, node: Node) -> bool: ...

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any: ...


@runtime_checkable
class BatchingExecutor(Executor, Protocol):
    """An ``Executor`` that sends nodes in batches: the optional method of the protocol.

    When an executor has ``run_backward_batched``, the engine calls it instead of
    ``run_backward``, with ``more_coming``: a callable answering True while the pass
    still holds ready nodes that its tasks will hand to the executor within a few
    event-loop ticks (a wide level is started by a pool of tasks that grows each tick),
    worth waiting for to send them together; False once every node the pass has made
    ready so far was handed over: send what is batched now. A chain answers False at
    every node, so a lone node never waits.
    """

    async def run_backward_batched(
        self,
        node: Node,
        grad_outputs: tuple[Variable | None, ...],
        more_coming: Callable[[], bool],
    ) -> Any: ...


_CURRENT: contextvars.ContextVar[Executor | None] = contextvars.ContextVar(
    "asyncgraph_executor", default=None
)


def current_executor() -> Executor:
    """The executor selected by ``use_executor`` in this task, else a LocalExecutor."""
    executor = _CURRENT.get()
    if executor is None:
        from asyncgraph._core._local_executor import DEFAULT_EXECUTOR

        return DEFAULT_EXECUTOR
    return executor


@contextmanager
def use_executor(executor: Executor) -> Iterator[Executor]:
    """Make ``executor`` the default of ``backward()`` inside the block (this task only).

    Example::

        with use_executor(LocalExecutor(max_concurrency=8)):
            await loss.backward()          # at most 8 backwards at once
    """
    if not isinstance(executor, Executor):
        raise TypeError(
            f"use_executor expects an Executor (methods inline and run_backward), got {executor!r}"
        )
    token = _CURRENT.set(executor)
    try:
        yield executor
    finally:
        _CURRENT.reset(token)


@runtime_checkable
class ForwardExecutor(Protocol):
    """Runs one forward elsewhere: what ``remote_forwards`` takes.

    ``apply(fn, *args, **kwargs)`` returns what ``fn.apply(*args, **kwargs)`` would
    (the node recorded in this process when an input requires grad), the forward
    having run where the executor sends it (``RedisExecutor.apply``: a worker).
    """

    async def apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...


_FORWARDS: contextvars.ContextVar[ForwardExecutor | None] = contextvars.ContextVar(
    "asyncgraph_forward_executor", default=None
)


def current_forward_executor() -> ForwardExecutor | None:
    """The executor of ``remote_forwards`` in this task, else None (forwards run here)."""
    return _FORWARDS.get()


@contextmanager
def remote_forwards(executor: ForwardExecutor | None) -> Iterator[ForwardExecutor | None]:
    """Run the forward of every ``dispatch = "remote"`` Function applied inside the block on
    ``executor`` (this task and the tasks it starts); None: in this process again.

    Only a Function whose forward is ``async def`` can go: its ``apply`` returns an
    awaitable, the forward's output arriving later. A synchronous forward's ``apply``
    returns the output itself, so inside the block it raises ``TypeError`` saying to
    make the forward async (or the Function ``dispatch = "local"``). Local Functions
    run here as always. Outputs, recorded nodes, graph order and gradients are those
    of the same forwards run in-process. Raises ``TypeError`` for an ``executor``
    without an async ``apply(fn, *args, **kwargs)``.

    Example::

        async with open_redis_executor(url) as executor:
            with remote_forwards(executor):
                score = await RunTests.apply(code)     # its forward runs on a worker
            await score.backward(executor=executor)
    """
    if executor is not None and not isinstance(executor, ForwardExecutor):
        raise TypeError(
            f"remote_forwards expects an executor with an async apply(fn, *args, **kwargs) "
            f"(e.g. a RedisExecutor) or None, got {executor!r}"
        )
    token = _FORWARDS.set(executor)
    try:
        yield executor
    finally:
        _FORWARDS.reset(token)
