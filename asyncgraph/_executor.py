from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from asyncgraph._graph import Node
    from asyncgraph._variable import Variable

__all__ = ["Executor", "current_executor", "more_nodes_coming", "use_executor"]


@runtime_checkable
class Executor(Protocol):
    """Runs one node's backward.

    ``inline(node)``: True when the engine may call the node's (synchronous,
    cheap) backward itself, in the task that made it ready; no task is created.
    ``run_backward(node, grad_outputs)``: run it (async, threaded, remote...)
    and return what the Function's backward returned: one gradient or a tuple,
    one per forward input. Raising fails the pass; the engine names the node.
    """

    def inline(self, node: Node) -> bool: ...

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any: ...


# Set by the engine for the tasks of a backward pass: says whether that pass still holds
# ready nodes that its tasks have not handed to the executor yet.
MORE_READY: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "asyncgraph_more_ready", default=None
)


def more_nodes_coming() -> bool:
    """For executors that send nodes in batches, called from ``run_backward``.

    True while the backward pass that called it still holds ready nodes that its
    tasks will hand to the executor within a few event-loop ticks (a wide level
    is started by a pool of tasks that grows each tick): worth waiting for, to
    send them together. False once every node the pass has made ready so far was
    handed over, and outside a backward pass: send what is batched now.
    """
    probe = MORE_READY.get()
    return probe is not None and probe()


_CURRENT: contextvars.ContextVar[Executor | None] = contextvars.ContextVar(
    "asyncgraph_executor", default=None
)


def current_executor() -> Executor:
    """The executor selected by ``use_executor`` in this task, else a LocalExecutor."""
    executor = _CURRENT.get()
    if executor is None:
        from asyncgraph._local_executor import DEFAULT_EXECUTOR

        return DEFAULT_EXECUTOR
    return executor


@contextmanager
def use_executor(executor: Executor) -> Iterator[Executor]:
    """Make ``executor`` the default of ``backward()`` inside the block (this task only)."""
    if not isinstance(executor, Executor):
        raise TypeError(
            f"use_executor expects an Executor (methods inline and run_backward), got {executor!r}"
        )
    token = _CURRENT.set(executor)
    try:
        yield executor
    finally:
        _CURRENT.reset(token)
