"""Yielding to the tasks that are ready to run, in as few event-loop passes as it takes."""

from __future__ import annotations

import sys

import anyio.lowlevel

__all__ = ["let_ready_tasks_run"]


def _running_on_asyncio() -> bool:
    asyncio = sys.modules.get("asyncio")  # not imported: not running on it (and no import)
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def let_ready_tasks_run() -> None:
    """Return once every task that was ready to run when called has taken a step.

    asyncio runs ready tasks first in, first out: one checkpoint. trio may run a
    batch of ready tasks in either order: two. (Each pass of a busy event loop
    costs some microseconds; a round trip's budget is a few hundred.)
    """
    await anyio.lowlevel.checkpoint()
    if not _running_on_asyncio():
        await anyio.lowlevel.checkpoint()
