"""The worker's task runner (``asyncgraph.distributed.worker._runner``), on asyncio and trio
(every async test runs on both): one implementation for both.

No Redis: the runner only runs coroutines under deadlines and stops them.
"""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.lowlevel
import pytest

from asyncgraph.distributed.worker._execute import Threads
from asyncgraph.distributed.worker._outcomes import Held
from asyncgraph.distributed.worker._runner import Runner

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def held(deadline_in_s: float = 30.0) -> Held:
    h = Held(b"1-0", key=("client", "1"))
    h.deadline = anyio.current_time() + deadline_in_s
    return h


class Task:
    """A task body that records how it ended."""

    def __init__(self, runner: Runner, h: Held, seconds: float = 30.0) -> None:
        self.runner, self.held, self.seconds = runner, h, seconds
        self.began = anyio.Event()
        self.ended: str | None = None

    async def __call__(self) -> None:
        if self.held.stopped is not None:
            self.ended = f"stopped before it began: {self.held.stopped}"
            return
        self.began.set()
        try:
            await anyio.sleep(self.seconds)
            self.ended = "finished"
        except anyio.get_cancelled_exc_class():
            why = self.runner.why_stopped(self.held)
            if why is None:
                self.ended = "cancelled by stop_all"
                raise
            self.ended = why


async def test_a_task_runs_to_its_end() -> None:
    async with Runner().serving() as runner:
        task = Task(runner, held(), seconds=0.01)
        runner.start(task.held, task)
    assert task.ended == "finished"


async def test_a_task_starts_only_while_its_runner_serves() -> None:
    runner = Runner()  # made with the worker's slots, long before the worker serves
    early = Task(runner, held())
    with pytest.raises(RuntimeError, match="serving"):
        runner.start(early.held, early)
    runner.stop_all()  # nothing runs yet: nothing to stop, nothing fails
    async with runner.serving():
        task = Task(runner, held(), seconds=0.01)
        runner.start(task.held, task)
    assert task.ended == "finished" and early.ended is None
    with pytest.raises(RuntimeError, match="serving"):
        runner.start(early.held, early)


async def test_a_stopped_task_sees_why_and_ends_normally() -> None:
    async with Runner().serving() as runner:
        task = Task(runner, held())
        runner.start(task.held, task)
        await task.began.wait()
        runner.stop(task.held, "cancelled")
        runner.stop(task.held, "expired")  # the first reason stands
    assert task.ended == "cancelled"


async def test_a_task_stopped_at_its_deadline_is_expired() -> None:
    with anyio.fail_after(60):
        async with Runner().serving() as runner:
            task = Task(runner, held(deadline_in_s=0.05))
            runner.start(task.held, task)
    assert task.ended == "expired"


async def test_a_task_stopped_before_it_began_is_told_when_it_begins() -> None:
    async with Runner().serving() as runner:
        task = Task(runner, held())
        runner.start(task.held, task)
        runner.stop(task.held, "cancelled")  # same tick: the task has not begun
    assert task.ended == "stopped before it began: cancelled"
    assert not task.began.is_set()


async def test_stop_all_cancels_every_task_without_a_reason() -> None:
    tasks: list[Task] = []
    with anyio.fail_after(60):
        async with Runner().serving() as runner:
            for _ in range(3):
                tasks.append(Task(runner, held()))
                runner.start(tasks[-1].held, tasks[-1])
            for task in tasks:
                await task.began.wait()
            runner.stop_all()
    assert [t.ended for t in tasks] == ["cancelled by stop_all"] * 3
    assert all(t.held.stopped is None for t in tasks)


async def test_leaving_the_block_cancelled_stops_the_tasks_and_waits_for_them() -> None:
    with anyio.move_on_after(5) as outer:
        async with Runner().serving() as runner:
            task = Task(runner, held())
            runner.start(task.held, task)
            await task.began.wait()
            outer.cancel()
            await anyio.sleep(10)
    assert outer.cancelled_caught
    assert task.ended == "cancelled by stop_all"  # ended before the block was left


async def test_a_task_that_raises_stops_the_block_and_the_error_comes_out() -> None:
    other: list[Task] = []

    async def broken() -> None:
        await anyio.lowlevel.checkpoint()
        raise RuntimeError("a bug of the worker")

    with anyio.fail_after(60), pytest.raises(BaseException) as info:
        async with Runner().serving() as runner:
            other.append(Task(runner, held()))
            runner.start(other[0].held, other[0])
            runner.start(held(), broken)
            await anyio.sleep(10)  # the crash cancels this
    errors = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else [info.value]
    assert [str(e) for e in errors] == ["a bug of the worker"]
    assert other[0].ended == "cancelled by stop_all"


async def test_a_threaded_call_stopped_while_it_runs_is_abandoned_not_awaited() -> None:
    told = anyio.Event()
    threads = Threads(2, on_ended=told.set)
    release = threading.Event()
    h = held()
    ended: list[str] = []

    async def body() -> None:
        try:
            await threads.run(release.wait, 10)
            ended.append("returned")
        except anyio.get_cancelled_exc_class():
            ended.append(runner.why_stopped(h) or "no reason")

    with anyio.fail_after(60):
        async with Runner().serving() as runner:
            runner.start(h, body)
            await anyio.sleep(0.1)
            runner.stop(h, "cancelled")
    assert ended == ["cancelled"]
    assert threads.abandoned == 1
    release.set()
    with anyio.fail_after(60):  # the call returns: the loop is told, its slot given back
        await told.wait()
    assert threads.abandoned == 0


def test_an_abandoned_call_returning_after_its_loop_stopped_does_not_hold_its_thread() -> None:
    # A thread waiting for a loop that no longer runs (the worker exited; with anyio's
    # pytest runner, the last test ended) would hold the process at exit forever.
    threads = Threads(1)
    release = threading.Event()
    workers: list[threading.Thread] = []

    def call() -> None:
        workers.append(threading.current_thread())
        release.wait(10)

    async def main() -> None:
        with anyio.move_on_after(0.2):
            await threads.run(call)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())  # the call is abandoned, the loop stops (not closed)
    try:
        assert threads.abandoned == 1 and len(workers) == 1
        release.set()
        workers[0].join(5)
        assert not workers[0].is_alive()  # it told the loop without waiting, and ended
    finally:
        release.set()
        loop.run_until_complete(asyncio.sleep(0.05))  # runs what the thread scheduled
        loop.close()
    assert threads.abandoned == 0


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again() -> None:
    """As an anyio cancel scope does at every checkpoint (trio's runner uses one)."""
    h = held()
    swallowed: list[str] = []
    ended: list[str] = []

    async def stubborn() -> None:
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            swallowed.append("once")
        try:
            await anyio.sleep(30)  # a Function that went on after the cancellation
        except anyio.get_cancelled_exc_class():
            ended.append(runner.why_stopped(h) or "no reason")
            raise

    with anyio.fail_after(60):
        async with Runner().serving() as runner:
            runner.start(h, stubborn)
            await anyio.sleep(0.05)
            runner.stop(h, "cancelled")
    assert swallowed == ["once"] and ended == ["cancelled"]


async def test_stop_all_ends_a_task_that_swallows_its_cancellation() -> None:
    rounds: list[int] = []

    async def stubborn() -> None:
        for i in range(3):
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                rounds.append(i)

    with anyio.fail_after(60):
        async with Runner().serving() as runner:
            runner.start(held(), stubborn)
            await anyio.sleep(0.05)
            runner.stop_all()
    assert rounds == [0, 1, 2]
