"""Remote Functions whose forwards the job tests run on local workers (``forward_on_workers``).

Workers import this module by name: put ``tests/`` on their ``PYTHONPATH`` (it is
``jobs.fleet_functions`` there, as under pytest), or ``tests/jobs`` for a job file that
imports it as ``fleet_functions``.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from asyncgraph import Function, Variable


class RemoteSquaredError(Function):
    """``(w * x - y) ** 2`` with an async forward: the line-fit loss, run where it is sent.

    The pid of the process that ran the forward is kept on ctx (``ctx.pid``), which
    travels back with the node.
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    async def forward(ctx: Any, w: Variable, x: float, y: float) -> Variable:
        ctx.residual = w.data * x - y
        ctx.x = x
        ctx.pid = os.getpid()
        return Variable(ctx.residual**2, role="squared error")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, None, None]:
        return (2 * ctx.residual * ctx.x * g.data, None, None)


class ForwardPid(Function):
    """The pid of the process that ran its forward (async): where a metric ran."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    async def forward(ctx: Any, x: Any) -> Variable:
        return Variable(os.getpid(), role="pid")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> None:
        return None


class SyncRemote(Function):
    """A remote Function with a synchronous forward: its apply cannot wait for a worker."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data * 2)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Any:
        return g.data * 2


class Weighted(Function):
    """``2 * a + 3 * b`` for numbers: distinct gradients per input, to catch a mix-up of
    inputs passed by keyword in another order than forward's signature."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    async def forward(ctx: Any, a: Variable, b: Variable, scale: float = 1.0) -> Variable:
        ctx.scale = scale
        return Variable(scale * (2 * a.data + 3 * b.data))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, Any, None]:
        return (2 * ctx.scale * g.data, 3 * ctx.scale * g.data, None)
