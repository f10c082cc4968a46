from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

if TYPE_CHECKING:
    from asyncgraph._core._graph import Node
    from asyncgraph._core._variable import Variable

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Run backwards in this process, on the caller's event loop.

    - ``async def`` backwards run as tasks of the backward pass;
    - synchronous backwards run inline (they are meant to be quick, like numeric
      ops), except for Functions with ``blocking = True`` (sync I/O, heavy CPU),
      which run in worker threads so they never stall the loop.

    ``max_concurrency`` bounds how many async or threaded backwards run at once
    (None: unbounded). Inline nodes are not counted.

    Example::

        await loss.backward(executor=LocalExecutor(max_concurrency=4))
    """

    def __init__(self, max_concurrency: int | None = None) -> None:
        if max_concurrency is not None and (
            not isinstance(max_concurrency, int) or max_concurrency < 1
        ):
            raise ValueError(
                f"max_concurrency must be a positive int or None, got {max_concurrency!r}"
            )
        self.max_concurrency = max_concurrency
        # One limiter per event loop: an executor may serve asyncio and trio runs.
        self._limiters: weakref.WeakKeyDictionary[Any, anyio.CapacityLimiter] = (
            weakref.WeakKeyDictionary()
        )

    def inline(self, node: Node) -> bool:
        fn = node.function
        return not fn._backward_is_async and not fn.blocking

    def _limiter(self) -> anyio.CapacityLimiter | None:
        if self.max_concurrency is None:
            return None
        loop = _current_loop()
        limiter = self._limiters.get(loop)
        if limiter is None:
            limiter = self._limiters[loop] = anyio.CapacityLimiter(self.max_concurrency)
        return limiter

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        limiter = self._limiter()
        if limiter is None:
            return await _call(node, grad_outputs)
        async with limiter:
            return await _call(node, grad_outputs)

    def __repr__(self) -> str:
        return f"LocalExecutor(max_concurrency={self.max_concurrency!r})"


async def _call(node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
    fn = node.function
    if fn._backward_is_async:
        return await fn.backward(node.ctx, *grad_outputs)
    if fn.blocking:
        # to_thread.run_sync copies the context, so grad mode follows into the thread.
        return await anyio.to_thread.run_sync(
            functools.partial(fn.backward, node.ctx, *grad_outputs), abandon_on_cancel=False
        )
    return fn.backward(node.ctx, *grad_outputs)


def _current_loop() -> Any:
    # The asyncio loop or trio's token: weakly referenceable, one per running loop.
    return anyio.lowlevel.current_token().native_token


DEFAULT_EXECUTOR = LocalExecutor()
