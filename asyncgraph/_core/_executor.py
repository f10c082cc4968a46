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
