"""Where a forward runs: ``remote_forwards`` sends the forwards of ``dispatch = "remote"``
Functions to a ``ForwardExecutor`` (a fleet); ``Function.apply`` asks
``current_forward_executor``. Imports nothing of the core: the graph's own modules use it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

__all__ = ["ForwardExecutor", "current_forward_executor", "remote_forwards"]


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
