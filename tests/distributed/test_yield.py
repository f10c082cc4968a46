"""``let_ready_tasks_run``: one code path on anyio's public API, on asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from asyncgraph.distributed._yield import let_ready_tasks_run

pytestmark = pytest.mark.anyio


async def _wake_tasks_at_once(count: int) -> list[int]:
    """Start ``count`` tasks waiting on one event, set it, let ready tasks run: who stepped."""
    stepped: list[int] = []
    woken = anyio.Event()

    async def step(i: int) -> None:
        await woken.wait()
        stepped.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(step, i)
        await let_ready_tasks_run()  # the tasks start and wait
        woken.set()  # all ready at once
        await let_ready_tasks_run()
        seen = sorted(stepped)
    return seen


async def test_every_task_ready_when_called_has_taken_a_step_when_it_returns() -> None:
    # trio runs a batch of ready tasks in either order: one checkpoint would let some
    # of these run after the caller. Repeated, so that both orders come up.
    for _ in range(50):
        assert await _wake_tasks_at_once(8) == list(range(8))
