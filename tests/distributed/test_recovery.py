"""Failures: killed and stalled workers, Redis restarts, cancellation, draining, poison tasks."""

from __future__ import annotations

import functools
import signal
import time

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, wait_for_workers, wait_until

from asyncgraph import Parameter, RemoteConnectionError, RemoteTimeoutError, backward
from asyncgraph._redis_server import RedisServer, free_port
from asyncgraph.executors import open_redis_executor

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

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
    outs = [F.Sleep.apply(F.Scale.apply(p, 2.0), 1.0, f"kill{i}") for i, p in enumerate(leaves)]
    async with open_redis_executor(redis_url, queue="kill", timeout_s=30) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(lambda: all(pids(redis_url, f"agdist:started:kill{i}") for i in range(6)))
            start_worker(redis_url, "kill", *FAST, "--concurrency", "8")
            first.kill()
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
    y = F.Sleep.apply(x, 1.0, "stall")
    async with open_redis_executor(redis_url, queue="stall", timeout_s=30) as ex:
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


async def test_redis_restart_mid_pass_is_a_clear_error_then_workers_recover(
    start_worker: StartWorker,
) -> None:
    with RedisServer() as server:
        start_worker(server.url, "restart", *FAST)
        x = Parameter(1.0)
        y = F.Sleep.apply(x, 30.0, "restart")
        async with open_redis_executor(server.url, queue="restart", timeout_s=60,
                                       redis_timeout_s=2) as ex:
            async with anyio.create_task_group() as tg:

                async def restart() -> None:
                    await wait_until(lambda: pids(server.url, "agdist:started:restart"))
                    await anyio.to_thread.run_sync(server.stop)
                    await anyio.to_thread.run_sync(server.start)

                tg.start_soon(restart)
                started = time.monotonic()
                with pytest.raises(RemoteConnectionError) as info:
                    await backward(y, executor=ex)
                elapsed = time.monotonic() - started
            assert isinstance(info.value, ConnectionError)
            assert "Sleep" in str(info.value) and "restart" in str(info.value)
            assert elapsed < 10
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
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, "cancel", *FAST, "--concurrency", "1")
    outs = [F.Sleep.apply(Parameter(1.0), 20.0, f"cancel{i}") for i in range(3)]
    async with open_redis_executor(redis_url, queue="cancel", timeout_s=30) as ex:
        with anyio.move_on_after(15) as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(backward, outs, executor=ex))
                running = await wait_until(lambda: [
                    i for i in range(3) if pids(redis_url, f"agdist:started:cancel{i}")])
                scope.cancel()
        assert scope.cancelled_caught
        assert ex.stats.cancelled == 3
    (i,) = running
    await wait_until(lambda: pids(redis_url, f"agdist:cancelled:cancel{i}"), timeout_s=5)
    await anyio.sleep(1.5)
    started = [j for j in range(3) if pids(redis_url, f"agdist:started:cancel{j}")]
    assert started == [i]  # the queued ones never ran


async def test_worker_added_mid_run_picks_up_work(redis_url: str, start_worker: StartWorker) -> None:
    first = start_worker(redis_url, "grow", *FAST, "--concurrency", "2")
    outs = [F.Sleep.apply(Parameter(1.0), 0.5, "grow") for _ in range(12)]
    async with open_redis_executor(redis_url, queue="grow", timeout_s=30) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(lambda: pids(redis_url, "agdist:started:grow"))
            second = start_worker(redis_url, "grow", *FAST, "--concurrency", "2", wait=False)
        assert ex.stats.completed == 12
    ran_on = pids(redis_url, "agdist:finished:grow")
    assert len(ran_on) == 12
    assert {first.pid, second.pid} == set(ran_on)


async def test_sigterm_drains_in_flight_tasks(redis_url: str, start_worker: StartWorker) -> None:
    worker = start_worker(redis_url, "drain", *FAST, "--drain-timeout-s", "20")
    x = Parameter(2.0)
    y = F.Sleep.apply(x, 1.0, "drain")
    async with open_redis_executor(redis_url, queue="drain", timeout_s=30) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, y, executor=ex))
            await wait_until(lambda: pids(redis_url, "agdist:started:drain"))
            worker.signal(signal.SIGTERM)
    assert x.grad is not None and x.grad.data == 1.0
    assert await anyio.to_thread.run_sync(worker.proc.wait, 10) == 0
    assert pids(redis_url, "agdist:finished:drain") == [worker.pid]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_deleted_task_held_by_a_dead_worker_is_cleared(
    redis_url: str, start_worker: StartWorker
) -> None:
    from asyncgraph.wire import _keys as keys

    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream("ghost")
    client.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    entry = client.xadd(stream, {b"m": b"\x80"})
    client.xreadgroup(keys.GROUP, "dead-worker", {stream: ">"})  # delivered, never acked
    client.xdel(stream, entry)  # then cancelled by its client
    start_worker(redis_url, "ghost", *FAST)
    await wait_until(lambda: client.xpending(stream, keys.GROUP)["pending"] == 0)
    client.close()
