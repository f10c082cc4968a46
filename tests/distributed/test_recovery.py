"""Failures: killed and stalled workers, Redis restarts, cancellation, draining, poison tasks."""

from __future__ import annotations

import functools
import os
import signal
import time

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, http_get, wait_for_workers, wait_until

from asyncgraph import Parameter, RemoteConnectionError, RemoteTimeoutError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed._redis_server import RedisServer, free_port
from asyncgraph.distributed.wire import _keys as keys

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")


def pids(url: str, key: str) -> list[int]:
    client = redis.Redis.from_url(url)
    try:
        return [int(p) for p in client.lrange(key, 0, -1)]
    finally:
        client.close()


async def test_sigkill_mid_task_loses_nothing_and_counts_once(
    redis_url: str, start_worker: StartWorker
) -> None:
    first = start_worker(redis_url, "kill", *FAST, "--concurrency", "8")
    leaves = [Parameter(float(i + 1), role=f"p{i}") for i in range(6)]
    # Tasks long enough that none finishes before the kill, even on a loaded machine.
    outs = [F.Sleep.apply(F.Scale.apply(p, 2.0), 5.0, f"kill{i}") for i, p in enumerate(leaves)]
    async with open_redis_executor(redis_url, queue="kill", timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(
                lambda: all(pids(redis_url, f"agdist:started:kill{i}") for i in range(6))
            )
            # Killed before the second worker starts: a start that takes seconds on a busy
            # machine no longer lets the first finish its tasks (was `assert 1 == 2`).
            first.kill()
            start_worker(redis_url, "kill", *FAST, "--concurrency", "8")
        assert ex.stats.completed == 12
    assert [p.grad.data for p in leaves] == [2.0] * 6  # type: ignore[union-attr]
    for i in range(6):
        # Ran twice (the killed worker never finished), joined once.
        assert len(pids(redis_url, f"agdist:started:kill{i}")) == 2
        assert len(pids(redis_url, f"agdist:finished:kill{i}")) == 1


async def test_stalled_worker_task_runs_twice_and_is_joined_once(
    redis_url: str, start_worker: StartWorker
) -> None:
    stalled = start_worker(redis_url, "stall", *FAST)
    x = Parameter(1.5, role="x")
    # A task long enough that it is still running when the worker is stopped, even if
    # polling sees it start late on a loaded machine.
    y = F.Sleep.apply(x, 5.0, "stall")
    async with open_redis_executor(redis_url, queue="stall", timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, y, executor=ex))
            await wait_until(lambda: pids(redis_url, "agdist:started:stall"))
            stalled.signal(signal.SIGSTOP)  # holds the task but stops renewing its lease
            start_worker(redis_url, "stall", *FAST)
        stalled.signal(signal.SIGCONT)
        # The stalled worker finishes too: its reply arrives and is ignored.
        await wait_until(lambda: ex.stats.duplicate_replies >= 1)
        assert ex.stats.completed == 1
    assert x.grad is not None and x.grad.data == 1.0
    assert len(pids(redis_url, "agdist:finished:stall")) == 2


async def test_a_worker_stalled_past_its_lease_counts_no_delivery_and_its_task_survives_it(
    redis_url: str, start_worker: StartWorker
) -> None:
    """A stall past the lease (a loaded machine) while no other worker takes the task: the
    stalled worker's own reclaimer must not claim it (each claim counts a delivery), so once
    it dies the next worker reruns the task instead of dead-lettering it as delivered
    max_attempts times (the call journal's tests failed so under load)."""
    stalled = start_worker(redis_url, "selfclaim", *FAST, "--max-attempts", "2")
    client = redis.Redis.from_url(redis_url)
    client.set("agdist:hold:selfclaim", 1)
    stream = keys.task_stream("selfclaim")

    def pending() -> tuple[int, int]:  # (idle ms, deliveries) of the one task
        (row,) = client.xpending_range(stream, keys.GROUP, "-", "+", 1)
        return int(row["time_since_delivered"]), int(row["times_delivered"])

    x = Parameter(1.5, role="x")
    async with open_redis_executor(redis_url, queue="selfclaim", timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, F.Held.apply(x, "selfclaim"), executor=ex))
            await wait_until(lambda: pids(redis_url, "agdist:started:selfclaim"))
            for _ in range(3):
                stalled.signal(signal.SIGSTOP)
                await wait_until(lambda: pending()[0] > 1500)  # its lease of 1 s has passed
                stalled.signal(signal.SIGCONT)
                await wait_until(lambda: pending()[0] < 1000)  # it took its task back
            assert pending()[1] == 1  # never delivered again: it never changed hands
            stalled.kill()
            start_worker(redis_url, "selfclaim", *FAST, "--max-attempts", "2")
            client.delete("agdist:hold:selfclaim")
        assert ex.stats.completed == 1
    client.close()
    assert x.grad is not None and x.grad.data == 1.0
    assert len(pids(redis_url, "agdist:started:selfclaim")) == 2  # rerun, not dead-lettered


async def test_redis_restart_mid_pass_is_a_clear_error_then_workers_recover(
    start_worker: StartWorker, redis_server_binary: None
) -> None:
    with RedisServer() as server:
        start_worker(server.url, "restart", *FAST)
        x = Parameter(1.0)
        y = F.Sleep.apply(x, 120.0, "restart")  # still running when the error comes
        async with open_redis_executor(
            server.url, queue="restart", timeout_s=120, redis_timeout_s=2
        ) as ex:
            async with anyio.create_task_group() as tg:

                async def restart() -> None:
                    await wait_until(lambda: pids(server.url, "agdist:started:restart"))
                    await anyio.to_thread.run_sync(server.stop)
                    await anyio.to_thread.run_sync(server.start)

                tg.start_soon(restart)
                # The lost connection: the 120 s timeout would raise RemoteTimeoutError.
                with pytest.raises(RemoteConnectionError) as info:
                    await backward(y, executor=ex)
            assert isinstance(info.value, ConnectionError)
            assert "Sleep" in str(info.value) and "restart" in str(info.value)
            assert x.grad is None
            # The worker reconnects and serves the same queue again.
            wait_for_workers(server.url, "restart", 1)
            z = F.Scale.apply(x, 4.0)
            await backward(z, executor=ex)
            assert x.grad is not None and x.grad.data == 4.0


async def test_unreachable_redis_fails_fast_at_open() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(RemoteConnectionError, match="cannot connect"):
        async with open_redis_executor(url, queue="nothing", redis_timeout_s=2):
            pass
    assert time.monotonic() - started < 3


async def test_no_worker_times_out_with_a_diagnosis(redis_url: str) -> None:
    x = Parameter(1.0)
    async with open_redis_executor(redis_url, queue="empty", timeout_s=0.5) as ex:
        with pytest.raises(RemoteTimeoutError) as info:
            await backward(F.Noop.apply(x), executor=ex)
    assert "no worker of queue 'empty' is alive" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    client = redis.Redis.from_url(redis_url)
    assert client.xlen("asyncgraph:{empty}:tasks") == 0  # cancelled: removed from the queue
    client.close()


async def test_cancelling_the_caller_stops_running_tasks_and_skips_queued_ones(
    redis_url: str, start_worker: StartWorker, anyio_backend: str
) -> None:
    # The worker runs on the client's event loop: each has its own task runner.
    start_worker(redis_url, "cancel", *FAST, "--concurrency", "1", "--backend", anyio_backend)
    from asyncgraph.distributed.wire import _keys as keys

    outs = [F.Sleep.apply(Parameter(1.0), 120.0, f"cancel{i}") for i in range(3)]
    async with open_redis_executor(redis_url, queue="cancel", timeout_s=120) as ex:
        with anyio.CancelScope() as scope:  # wait_until's deadline guards the wait
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(backward, outs, executor=ex))
                running = await wait_until(
                    lambda: [i for i in range(3) if pids(redis_url, f"agdist:started:cancel{i}")]
                )
                scope.cancel()
        assert scope.cancelled_caught
        assert ex.stats.cancelled == 3
    (i,) = running
    await wait_until(lambda: pids(redis_url, f"agdist:cancelled:cancel{i}"))
    # Nothing left to run: the queued tasks are gone from the stream and the worker holds
    # none (one it had taken would be pending until it ran), so every start is recorded.
    client = redis.Redis.from_url(redis_url)
    try:
        stream = keys.task_stream("cancel")
        await wait_until(
            lambda: client.xlen(stream) == 0 and client.xpending(stream, keys.GROUP)["pending"] == 0
        )
    finally:
        client.close()
    started = [j for j in range(3) if pids(redis_url, f"agdist:started:cancel{j}")]
    assert started == [i]  # the queued ones never ran


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_worker_added_mid_run_picks_up_work(
    redis_url: str, start_worker: StartWorker
) -> None:
    first = start_worker(redis_url, "grow", *FAST, "--concurrency", "2")
    client = redis.Redis.from_url(redis_url)
    client.set("agdist:hold:grow", 1)  # the first worker's two slots stay busy meanwhile
    outs = [F.Held.apply(Parameter(1.0), "grow") for _ in range(12)]
    async with open_redis_executor(redis_url, queue="grow", timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(lambda: len(pids(redis_url, "agdist:started:grow")) == 2)
            second = start_worker(redis_url, "grow", *FAST, "--concurrency", "2", wait=False)
            await wait_until(lambda: len(pids(redis_url, "agdist:started:grow")) == 4)
            client.delete("agdist:hold:grow")
        assert ex.stats.completed == 12
    client.close()
    ran_on = pids(redis_url, "agdist:finished:grow")
    assert len(ran_on) == 12
    assert {first.pid, second.pid} == set(ran_on)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_sigterm_drains_in_flight_tasks(redis_url: str, start_worker: StartWorker) -> None:
    worker = start_worker(redis_url, "drain", *FAST, "--drain-timeout-s", "60")
    x = Parameter(2.0)
    y = F.Sleep.apply(x, 5.0, "drain")  # still running at the SIGTERM on a loaded machine
    async with open_redis_executor(redis_url, queue="drain", timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, y, executor=ex))
            await wait_until(lambda: pids(redis_url, "agdist:started:drain"))
            worker.signal(signal.SIGTERM)
    assert x.grad is not None and x.grad.data == 1.0
    assert await anyio.to_thread.run_sync(worker.proc.wait, 60) == 0
    assert pids(redis_url, "agdist:finished:drain") == [worker.pid]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_deleted_task_held_by_a_dead_worker_is_cleared(
    redis_url: str, start_worker: StartWorker
) -> None:
    from asyncgraph.distributed.wire import _keys as keys

    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream("ghost")
    client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    entry = client.xadd(stream, {b"m": b"\x80"})
    client.xreadgroup(keys.GROUP, "dead-worker", {stream: ">"})  # delivered, never acked
    client.xdel(stream, entry)  # then cancelled by its client
    start_worker(redis_url, "ghost", *FAST)
    await wait_until(lambda: client.xpending(stream, keys.GROUP)["pending"] == 0)
    client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_slow_synchronous_backwards_run_in_threads_without_losing_their_lease(
    redis_url: str, start_worker: StartWorker
) -> None:
    # Each sleeps 3 leases in time.sleep. On the event loop it would stop lease renewals:
    # the second worker would reclaim and rerun it, and the two would run one after the other.
    first = start_worker(redis_url, "sync", "--lease-ms", "500", "--concurrency", "4")
    outs = [F.SyncSleep.apply(Parameter(1.0), 1.5, f"sync{i}") for i in range(2)]

    def runs(kind: str, i: int) -> list[tuple[int, float]]:
        client = redis.Redis.from_url(redis_url)
        try:
            rows = client.lrange(f"agdist:sync-{kind}:sync{i}", 0, -1)
        finally:
            client.close()
        return [(int(pid), float(at)) for pid, at in (row.split() for row in rows)]

    async with open_redis_executor(redis_url, queue="sync", timeout_s=30) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(lambda: runs("started", 0) and runs("started", 1))
            start_worker(redis_url, "sync", "--lease-ms", "500")  # would reclaim a lapsed lease
        assert ex.stats.duplicate_replies == 0
    (start0,), (start1,) = runs("started", 0), runs("started", 1)  # each ran once
    (end0,), (end1,) = runs("finished", 0), runs("finished", 1)
    assert {start0[0], start1[0]} == {first.pid}
    assert start1[1] < end0[1] and start0[1] < end1[1]  # at the same time


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # what Redis says, not the client's loop
async def test_timeout_diagnosis_says_where_the_task_is(
    redis_server_url: str, shared_fleet: str
) -> None:
    x = Parameter(1.0)
    # 3 s: on a loaded machine a worker may take the task only near a 1 s deadline. The
    # worker expires it 0.5 s after the client's deadline, so the diagnosis still sees it.
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=3.0) as ex:
        with pytest.raises(RemoteTimeoutError) as info:
            await backward(F.Sleep.apply(x, 10.0, "diagnosed"), executor=ex)
    message = str(info.value)
    assert "is being processed by worker" in message and "delivered 1 time(s)" in message
    assert "2 worker(s) alive" in message


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_a_worker_started_before_redis_waits_for_it(start_worker: StartWorker) -> None:
    port, health = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    start_worker(
        url, "early", *FAST, "--health-port", str(health), "--health-host", "127.0.0.1", wait=False
    )
    await wait_until(lambda: http_get(health, "/livez")[0] == 200)
    status, body = http_get(health, "/readyz")
    assert status == 503 and "connecting to Redis" in body
    with RedisServer(port=port):
        await anyio.to_thread.run_sync(wait_for_workers, url, "early", 1)
        await wait_until(lambda: http_get(health, "/readyz")[0] == 200)
        x = Parameter(1.0)
        async with open_redis_executor(url, queue="early", timeout_s=20) as ex:
            await backward(F.Scale.apply(x, 2.0), executor=ex)
        assert x.grad is not None and x.grad.data == 2.0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.slow
async def test_connect_timeout_ends_the_worker_with_a_clear_error() -> None:
    import subprocess
    import sys

    from agdist_helpers import HERE

    # The checkout's root first on the path: the test must not depend on how (or
    # whether) asyncgraph was installed into this interpreter.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), str(HERE)]))
    done = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "asyncgraph",
                "worker",
                "--redis",
                f"redis://127.0.0.1:{free_port()}/0",
                "--import",
                "agdist_functions",
                "--connect-timeout-s",
                "0.5",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=HERE,
            env=env,
        )
    )
    assert done.returncode == 1
    assert "did not answer within connect_timeout_s=0.5" in done.stderr
    assert "cannot reach Redis (attempt 1)" in done.stderr  # each failure is logged
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_idle_consumers_are_deleted_and_a_drained_worker_deletes_its_own(
    redis_url: str, start_worker: StartWorker
) -> None:
    from asyncgraph.distributed.wire import _keys as keys

    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream("tidy")
    client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    for name in ("ghost", "beating"):
        client.execute_command("XGROUP", "CREATECONSUMER", stream, keys.GROUP, name)
    # "beating" has a live heartbeat (an idle worker): it must stay.
    client.hset(keys.workers_hash("tidy"), "beating", int(time.time() * 1000) + 3_600_000)

    def consumers() -> set[str]:
        return {
            c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            for c in client.xinfo_consumers(stream, keys.GROUP)
        }

    # lease 200 ms: consumers idle 0.4 s (2 leases), holding nothing, without a heartbeat go.
    worker = start_worker(redis_url, "tidy", "--lease-ms", "200", "--drain-timeout-s", "1")
    x = Parameter(1.0)
    async with open_redis_executor(redis_url, queue="tidy", timeout_s=20) as ex:
        await backward(F.Scale.apply(x, 2.0), executor=ex)  # the worker's consumer exists now
    await wait_until(lambda: "ghost" not in consumers())
    names = consumers()
    assert "beating" in names and len(names) == 2  # and the worker itself
    worker.signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(worker.proc.wait, 10) == 0
    assert consumers() == {"beating"}  # drained, nothing pending: deleted its consumer
    client.close()
