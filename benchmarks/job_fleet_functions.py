"""The remote metric of ``bench_job_fleet.py`` (``--import job_fleet_functions``)."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Literal

import anyio

from asyncgraph import Function, Variable

BURN_MS = float(os.environ.get("BENCH_BURN_MS", "50"))


def burn(ms: float) -> int:
    """Spin the CPU for ``ms`` milliseconds of this thread's CPU time (not wall time)."""
    end = time.thread_time() + ms / 1000
    n = 0
    while time.thread_time() < end:
        n += 1
    return n


class BurnMetric(Function):
    """``(w * x - y) ** 2``, after ``BURN_MS`` of CPU: a metric that runs tests or code.

    Its forward is async (it can run on a worker: ``forward_on_workers``); the burn runs
    in a thread, so a worker's event loop keeps answering while it runs.
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    async def forward(ctx: Any, w: Variable, x: float, y: float) -> Variable:
        await anyio.to_thread.run_sync(burn, BURN_MS)
        ctx.residual = w.data * x - y
        ctx.x = x
        return Variable(ctx.residual**2, role="squared error")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, None, None]:
        return (2 * ctx.residual * ctx.x * g.data, None, None)
