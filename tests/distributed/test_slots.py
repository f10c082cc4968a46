"""The worker's shared state (``_slots.Slots``, ``_context.WorkerContext``) and the parts that
read it instead of calling back into ``Worker``, on asyncio and trio.

No Redis: a context makes a pool that never connects unless used.
"""

from __future__ import annotations

import json
import threading

import anyio
import anyio.from_thread
import pytest
from agdist_helpers import wait_until

from asyncgraph.distributed import Worker, WorkerConfig
from asyncgraph.distributed.worker._cancels import MAX_CANCELLED, Cancels
from asyncgraph.distributed.worker._context import Stopping, WorkerContext
from asyncgraph.distributed.worker._membership import Membership
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._slots import FINISHED_MEMORY, Slots

pytestmark = [pytest.mark.timeout(120)]

NOWHERE = "redis://127.0.0.1:1/0"


def test_a_slot_is_taken_once_and_freed_when_its_settlement_is_written() -> None:
    metrics = Metrics()
    slots = Slots(2, metrics)
    first = slots.hold(b"1-0", 1)
    assert first is not None and first.entry_id == b"1-0" and first.delivery == 1
    assert slots.hold(b"1-0", 2) is None  # held already: a reclaim returned it
    assert slots.hold(b"2-0", 3) is not None
    assert slots.free == 0
    slots.release([b"1-0"])
    assert slots.free == 1
    assert list(slots.held) == [b"2-0"]
    assert metrics.get("asyncgraph_worker_tasks_in_flight") == 1
    assert slots.hold(b"1-0", 2) is None  # settled a moment ago: never run twice


def test_the_memory_of_settled_entries_is_bounded() -> None:
    slots = Slots(1, Metrics())
    slots.release([f"{i}-0".encode() for i in range(FINISHED_MEMORY + 1)])
    assert slots.hold(b"0-0", 2) is not None  # the oldest was forgotten
    assert slots.hold(f"{FINISHED_MEMORY}-0".encode(), 2) is None


def test_an_abandoned_thread_call_takes_no_slot() -> None:
    metrics = Metrics()
    slots = Slots(2, metrics)
    slots.threads.abandoned = 2  # as Threads counts calls cancelled while they run
    assert slots.free == 2
    slots.threads.abandoned = 0
    slots.threads.on_ended()  # what Threads calls when such a call returns
    assert metrics.get("asyncgraph_worker_abandoned_calls") == 0


async def abandon_one(slots: Slots, release: threading.Event) -> None:
    """Cancel a synchronous call of ``slots.threads`` while it runs (until ``release``)."""
    started = anyio.Event()

    def hang() -> None:
        anyio.from_thread.run_sync(started.set)
        release.wait(30)

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(slots.threads.run, hang)
            await started.wait()
            scope.cancel()


@pytest.mark.anyio
async def test_abandoned_calls_leave_room_for_new_ones_and_past_the_bound_ask_for_a_drain() -> None:
    # On trio an abandoned call keeps its thread's limiter token until it returns: the
    # threads must have room for the calls abandoned besides those of the tasks held.
    too_many: list[int] = []
    slots = Slots(
        2, Metrics(), max_abandoned=2, too_many_abandoned=lambda: too_many.append(slots.abandoned)
    )
    release = threading.Event()
    try:
        with anyio.fail_after(60):
            await abandon_one(slots, release)
            await abandon_one(slots, release)
            assert slots.abandoned == 2 and too_many == []
            assert await slots.threads.run(lambda: "served") == "served"
            assert await slots.threads.run(lambda: "and again") == "and again"
            await abandon_one(slots, release)
        assert too_many == [3]  # one beyond max_abandoned
    finally:
        release.set()
    await wait_until(lambda: not slots.abandoned)


@pytest.mark.anyio
async def test_a_worker_past_max_abandoned_drains_to_be_replaced() -> None:
    # The worker gives its slots what to do past the bound when it makes them.
    worker = Worker(WorkerConfig(NOWHERE, queue="q", concurrency=1, max_abandoned=1), {})
    slots = worker._ctx.slots
    release = threading.Event()
    try:
        with anyio.fail_after(60):
            await abandon_one(slots, release)
            assert not worker.needs_replacing
            await abandon_one(slots, release)
        assert worker.needs_replacing
        assert worker.health()[1]["status"] == "draining: too many abandoned calls"
    finally:
        release.set()
    await wait_until(lambda: not slots.abandoned)


def test_max_abandoned_defaults_to_the_concurrency() -> None:
    assert Slots(3, Metrics()).max_abandoned == 3
    assert Slots(3, Metrics(), max_abandoned=1).max_abandoned == 1


@pytest.mark.anyio
async def test_the_reader_and_a_drain_both_wake_when_slots_are_released() -> None:
    slots = Slots(1, Metrics())
    slots.hold(b"1-0", 1)
    woke: list[str] = []

    async def reader() -> None:
        woke.append(f"free {await slots.wait_free()}")

    async def drain() -> None:
        await slots.wait_idle()
        woke.append("idle")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(drain)
            await anyio.wait_all_tasks_blocked()
            slots.changed()  # nothing was freed: both wait on
            await anyio.wait_all_tasks_blocked()
            assert woke == []
            slots.release([b"1-0"])
    assert sorted(woke) == ["free 1", "idle"]


@pytest.mark.anyio
async def test_waiting_for_a_free_slot_returns_at_once_when_one_is() -> None:
    slots = Slots(3, Metrics())
    slots.hold(b"1-0", 1)
    with anyio.fail_after(30):  # no release comes: it would block until this deadline
        assert await slots.wait_free() == 2
        slots.release([b"1-0"])
        await slots.wait_idle()


@pytest.mark.anyio
async def test_a_cancel_message_stops_the_running_task_through_the_slots() -> None:
    ctx = WorkerContext.new(WorkerConfig(NOWHERE, queue="q"))
    cancels = Cancels(ctx)
    ended: list[str | None] = []
    async with ctx.slots.runner.serving() as runner:
        held = ctx.slots.hold(b"1-0", 1)
        assert held is not None
        held.key = ("client", "t1")
        held.deadline = anyio.current_time() + 30
        ctx.slots.running[held.key] = held
        began = anyio.Event()

        async def task() -> None:
            began.set()
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                ended.append(runner.why_stopped(held))

        runner.start(held, task)
        await began.wait()
        cancels.cancel("client", ["other"])  # not held here: nothing stops
        await anyio.wait_all_tasks_blocked()
        assert ended == []
        cancels.cancel("client", ["t1"])
    assert ended == ["cancelled"]
    assert ("client", "t1") in cancels and ("client", "other") in cancels


def test_a_cancel_before_the_worker_serves_is_remembered() -> None:
    ctx = WorkerContext.new(WorkerConfig(NOWHERE, queue="q"))
    cancels = Cancels(ctx)
    cancels.cancel("client", ["t1"])  # no runner yet: nothing to stop, nothing fails
    assert ("client", "t1") in cancels


def test_the_remembered_cancels_are_bounded_the_oldest_forgotten_first() -> None:
    ctx = WorkerContext.new(WorkerConfig(NOWHERE, queue="q"))
    cancels = Cancels(ctx)
    cancels.cancel("old", ["t0"])
    cancels.cancel("flood", [str(i) for i in range(MAX_CANCELLED)])
    assert len(cancels) == MAX_CANCELLED
    assert ("old", "t0") not in cancels
    assert ("flood", "0") in cancels and ("flood", str(MAX_CANCELLED - 1)) in cancels
    cancels.cancel("flood", ["0"])  # cancelled again: now the newest
    cancels.cancel("new", ["t1"])
    assert ("flood", "0") in cancels and ("flood", "1") not in cancels
    cancels.forget_old()  # none is an hour old
    assert len(cancels) == MAX_CANCELLED


def test_the_status_a_worker_publishes_reads_the_shared_state() -> None:
    ctx = WorkerContext.new(WorkerConfig(NOWHERE, queue="q", concurrency=4))
    membership = Membership(ctx)
    ctx.slots.hold(b"1-0", 1)
    ctx.slots.threads.abandoned = 1
    ctx.stopping.drain()
    info = json.loads(membership.info_json())
    assert (info["concurrency"], info["in_flight"], info["abandoned"]) == (4, 1, 1)
    assert info["draining"] is True


@pytest.mark.anyio
async def test_a_drain_cancels_the_open_scopes_and_those_opened_after_it() -> None:
    stopping = Stopping()
    with stopping.scope() as scope:
        assert not scope.cancel_called
        stopping.drain()
        assert scope.cancel_called
        await anyio.sleep(30)  # cancelled: the block ends at once
    reached = False
    with stopping.scope():
        await anyio.sleep(30)
        reached = True
    assert stopping.draining and not reached


def test_a_context_names_its_consumer_unless_the_config_does() -> None:
    named = WorkerContext.new(WorkerConfig(NOWHERE, consumer="w1"))
    assert named.consumer == "w1" and named.health.consumer == "w1"
    one, two = WorkerContext.new(WorkerConfig(NOWHERE)), WorkerContext.new(WorkerConfig(NOWHERE))
    assert one.consumer != two.consumer
    assert one.slots.concurrency == WorkerConfig(NOWHERE).concurrency
