"""Yielding to the tasks that are ready to run, on any event loop anyio runs on."""

from __future__ import annotations

import anyio.lowlevel

__all__ = ["let_ready_tasks_run"]


async def let_ready_tasks_run() -> None:
    """Return once every task that was ready to run when called has taken a step.

    Two checkpoints: trio runs a batch of ready tasks in either order, so a task made
    ready in the caller's batch may run after the caller's first checkpoint, never
    after its second. (asyncio, first in first out, would need one; the second costs
    one more pass of the loop, microseconds, against a round trip of hundreds.)
    """
    await anyio.lowlevel.checkpoint()
    await anyio.lowlevel.checkpoint()
