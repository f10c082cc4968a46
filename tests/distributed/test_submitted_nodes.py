"""Remote nodes that wait without a task each (NOTE [Submitted nodes] in the engine), on a
real redis-server with real worker processes: how a pass ends when the executor closes,
when one node fails while others are out, and when nodes time out together."""

from __future__ import annotations

from typing import Any

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, wait_until

from asyncgraph import BackwardError, Parameter, RemoteError, RemoteTimeoutError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]
FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")


def _recorded(url: str, key: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return client.lrange(key, 0, -1)  # type: ignore[return-value]
    finally:
        client.close()


def _queue_empty(url: str, queue: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        stream = keys.task_stream(queue)
        return client.xlen(stream) == 0 and client.xpending(stream, keys.GROUP)["pending"] == 0
    finally:
        client.close()


async def test_closing_the_executor_fails_the_nodes_it_still_waits_for(
    redis_url: str, start_worker: StartWorker, anyio_backend: str
) -> None:
    start_worker(redis_url, "closing", *FAST, "--concurrency", "4", "--backend", anyio_backend)
    leaves = [Parameter(1.0) for _ in range(3)]
    outs = [F.Sleep.apply(p, 120.0, f"closing{i}") for i, p in enumerate(leaves)]
    errors: list[BaseException] = []

    async def run(ex: Any) -> None:
        try:
            await backward(outs, executor=ex)
        except BackwardError as exc:
            errors.append(exc)

    with anyio.fail_after(60):  # a pass left waiting would hang here
        async with anyio.create_task_group() as tg:
            async with open_redis_executor(redis_url, queue="closing", timeout_s=120) as ex:
                tg.start_soon(run, ex)
                await wait_until(
                    lambda: all(
                        _recorded(redis_url, f"agdist:started:closing{i}") for i in range(3)
                    )
                )
    (error,) = errors
    assert "was closed while this node waited" in str(error)
    assert all(p.grad is None for p in leaves)
    # The workers were told: every task stopped, none left in the queue.
    await wait_until(
        lambda: all(_recorded(redis_url, f"agdist:cancelled:closing{i}") for i in range(3))
    )
    await wait_until(lambda: _queue_empty(redis_url, "closing"))


async def test_a_failed_node_cancels_the_others_on_the_workers(
    redis_url: str, start_worker: StartWorker, anyio_backend: str
) -> None:
    start_worker(redis_url, "failing", *FAST, "--concurrency", "4", "--backend", anyio_backend)
    leaves = [Parameter(1.0) for _ in range(3)]
    outs = [
        F.Sleep.apply(leaves[0], 120.0, "failing0"),
        F.Sleep.apply(leaves[1], 120.0, "failing1"),
        F.Boom.apply(leaves[2]),
    ]
    async with open_redis_executor(redis_url, queue="failing", timeout_s=120) as ex:
        with anyio.fail_after(60), pytest.raises(RemoteError, match="boom on") as info:
            await backward(outs, executor=ex)
        assert info.value.function == "Boom"
        assert ex.stats.cancelled == 2
    assert all(p.grad is None for p in leaves)
    await wait_until(lambda: _queue_empty(redis_url, "failing"))
    for i in range(2):  # each sleeper that started was stopped, not left to run 120 s
        if _recorded(redis_url, f"agdist:started:failing{i}"):
            await wait_until(lambda i=i: _recorded(redis_url, f"agdist:cancelled:failing{i}"))
        assert not _recorded(redis_url, f"agdist:finished:failing{i}")


async def test_nodes_timing_out_together_each_get_a_diagnosis(redis_url: str) -> None:
    leaves = [Parameter(1.0) for _ in range(3)]
    async with open_redis_executor(redis_url, queue="nobody", timeout_s=0.5) as ex:
        with anyio.fail_after(30), pytest.raises(RemoteTimeoutError) as info:
            await backward([F.Noop.apply(p) for p in leaves], executor=ex)
    assert "no worker of queue 'nobody' is alive" in str(info.value)
    assert info.value.function == "Noop"
    await wait_until(lambda: _queue_empty(redis_url, "nobody"))  # all cancelled


async def test_a_diagnosis_that_fails_is_said_and_the_executor_keeps_serving(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def cannot_ask(pending: Any) -> str:
        raise RuntimeError("the diagnosis broke")

    async with open_redis_executor(redis_url, queue="undiagnosed", timeout_s=0.5) as ex:
        monkeypatch.setattr(ex.channel, "diagnose", cannot_ask)
        for _ in range(2):  # the second pass shows the executor's own tasks still run
            with anyio.fail_after(30), pytest.raises(RemoteTimeoutError) as info:
                await backward(F.Noop.apply(Parameter(1.0)), executor=ex)
            assert "could not ask Redis why (RuntimeError: the diagnosis broke)" in str(info.value)
