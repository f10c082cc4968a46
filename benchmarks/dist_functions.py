"""Remote Functions served by the benchmark's workers (``--import dist_functions``)."""

from __future__ import annotations

from typing import Any

import anyio

from asyncgraph import Function, Variable


class Noop(Function):
    """The cheapest remote node: the gradient passes through, on the worker's event loop.

    Async on purpose: a worker runs every synchronous backward in a thread (see SyncNoop).
    """

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Variable:
        return grad


class SyncNoop(Function):
    """The same with a synchronous backward: it runs in one of the worker's threads."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Variable:
        return grad


class Sleep(Function):
    """A slow remote node (an LLM call stand-in): sleeps ``seconds`` in backward."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, seconds: float) -> Variable:
        ctx.seconds = seconds
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> tuple[Variable, None]:
        await anyio.sleep(ctx.seconds)
        return grad, None
