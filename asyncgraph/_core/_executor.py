from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncgraph._core._local_executor import DEFAULT_EXECUTOR

if TYPE_CHECKING:
    from asyncgraph._core._graph import Node
    from asyncgraph._core._variable import Variable

__all__ = [
    "BatchingExecutor",
    "Executor",
    "SubmittingExecutor",
    "current_executor",
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


@runtime_checkable
class SubmittingExecutor(Executor, Protocol):
    """An ``Executor`` whose nodes wait without a task each: the other optional methods.

    For the nodes it ``submits(node)`` (ones that wait on something outside the process,
    as a worker's reply), the engine calls ``submit_backward(node, grads, done)`` from the
    task that made the node ready, instead of starting a task that awaits
    ``run_backward``: the executor queues the node and returns a hashable handle (raising
    fails the pass, naming the node). Once the engine has handed over what is ready (256
    nodes at most), it awaits ``send_submitted()``: what was queued leaves as one batch. When a node's outcome is in
    (and anything it must wait for, such as a timeout's diagnosis, is done), the executor
    calls ``done.put(handle)``; the engine then calls ``collect_backward(handle)``, which
    returns what the Function's backward returned or raises its error. A pass that ends
    first (failed, cancelled) awaits ``abandon_submitted(handles)`` (shielded) for the
    handles still out. ``send_submitted`` and ``abandon_submitted`` report a failure to send
    through ``done`` (the node's error), not by raising. NOTE [Submitted nodes] in
    ``_engine``.
    """

    def submits(self, node: Node) -> bool: ...

    def submit_backward(
        self, node: Node, grad_outputs: tuple[Variable | None, ...], done: Any
    ) -> Any: ...

    async def send_submitted(self) -> None: ...

    def collect_backward(self, handle: Any) -> Any: ...

    async def abandon_submitted(self, handles: list[Any]) -> None: ...


_CURRENT: contextvars.ContextVar[Executor | None] = contextvars.ContextVar(
    "asyncgraph_executor", default=None
)


def current_executor() -> Executor:
    """The executor selected by ``use_executor`` in this task, else a LocalExecutor."""
    executor = _CURRENT.get()
    return DEFAULT_EXECUTOR if executor is None else executor


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
