"""A worker keeps serving: past hung synchronous calls, through a crash loop, under floods of
cancels; and its health endpoint stays on this machine unless told otherwise.

Real ``asyncgraph worker`` processes and a real redis-server.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, http_get, wait_for_workers, wait_until

from asyncgraph import Parameter, RemoteTimeoutError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed._redis_server import free_port
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import CancelMessage, decode, encode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._cancels import MAX_IDS_PER_CANCEL

# The client's loop does not matter here: what is tested happens in the worker processes.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),
]


def worker_infos(url: str, queue: str) -> list[dict[str, object]]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(v) for v in client.hgetall(keys.workers_info_hash(queue)).values()]
    finally:
        client.close()


async def hang_sync_calls(url: str, queue: str, count: int, tag: str) -> None:
    """``count`` synchronous backwards that sleep 20 s, given up by their client after 2 s."""
    outs = [F.SyncSleep.apply(Parameter(1.0), 20.0, f"{tag}{i}") for i in range(count)]
    async with open_redis_executor(url, queue=queue, timeout_s=2.0) as ex:
        with pytest.raises(RemoteTimeoutError):
            await backward(outs, executor=ex)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_hung_synchronous_calls_do_not_starve_the_worker(
    redis_url: str, start_worker: StartWorker, backend: str
) -> None:
    # Every slot runs into a hung call; they are abandoned (Python cannot stop a thread),
    # visible in the worker's status, and the next normal pass is served at once.
    start_worker(redis_url, "hung", "--concurrency", "16", "--backend", backend)
    await hang_sync_calls(redis_url, "hung", 16, "hung")
    await wait_until(lambda: [i["abandoned"] for i in worker_infos(redis_url, "hung")] == [16])
    x = Parameter(1.0)
    async with open_redis_executor(redis_url, queue="hung", timeout_s=5.0) as ex:
        await backward(F.Scale.apply(x, 2.0), executor=ex)
    assert x.grad is not None and x.grad.data == 2.0


async def test_past_max_abandoned_a_worker_drains_and_exits_to_be_replaced(
    redis_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker(redis_url, "worn", "--concurrency", "4", "--max-abandoned", "2")
    await hang_sync_calls(redis_url, "worn", 3, "worn")
    code = await anyio.to_thread.run_sync(worker.proc.wait, 30)
    assert code == 75  # EX_TEMPFAIL: a supervisor or orchestrator starts a fresh one
    # Under --processes, its supervisor replaces it: two children of two slots each, both
    # past one abandoned call.
    start_worker(
        redis_url, "worn", "--concurrency", "2", "--max-abandoned", "1", "--processes", "2"
    )
    await anyio.to_thread.run_sync(wait_for_workers, redis_url, "worn", 2)
    first = {i["pid"] for i in worker_infos(redis_url, "worn")}
    await hang_sync_calls(redis_url, "worn", 4, "worn-sup")
    await wait_until(lambda: {i["pid"] for i in worker_infos(redis_url, "worn")} - first, 30)
    x = Parameter(1.0)
    async with open_redis_executor(redis_url, queue="worn", timeout_s=30.0) as ex:
        await backward(F.Scale.apply(x, 2.0), executor=ex)
    assert x.grad is not None and x.grad.data == 2.0


async def test_a_crash_looping_worker_leaves_few_consumers_in_the_group(
    redis_url: str, start_worker: StartWorker
) -> None:
    # Each worker lives far less than the housekeeping period (6 s at this lease): only the
    # sweep each one makes at start keeps the group small.
    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream("loop")

    def consumers() -> set[str]:
        try:
            return {c["name"].decode() for c in client.xinfo_consumers(stream, keys.GROUP)}
        except redis.ResponseError:  # no group yet
            return set()

    async def serve_one(worker: str) -> None:
        # A consumer exists once it was given a task (Redis 6.2; 7 makes it at its first read).
        x = Parameter(1.0)
        async with open_redis_executor(redis_url, queue="loop", timeout_s=10.0) as ex:
            await backward(F.Scale.apply(x, 2.0), executor=ex)
        assert worker in consumers()

    for i in range(6):
        worker = start_worker(redis_url, "loop", "--lease-ms", "1000", "--consumer", f"w{i}")
        await serve_one(f"w{i}")
        worker.kill()
    start_worker(redis_url, "loop", "--lease-ms", "1000", "--consumer", "last")
    await serve_one("last")
    # Before the periodic sweep (6 s after start) could have run: the sweep at start took
    # the consumers dead for two leases, the one two leases later those killed just before.
    await wait_until(lambda: len(consumers()) <= 3, 4.0)
    assert "w0" not in consumers() and "last" in consumers()
    client.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
async def test_a_cancel_flood_is_refused_and_the_worker_stays_small(
    redis_url: str, start_worker: StartWorker
) -> None:
    port = free_port()
    worker = start_worker(redis_url, "flood", "--health-port", str(port))

    def refused() -> bool:
        status, text = http_get(port, "/metrics")
        return status == 200 and 'dead_letters_total{reason="bad_cancel"} 1' in text

    await wait_until(lambda: http_get(port, "/livez")[0] == 200)
    before = rss_mb(worker.pid)
    # 950,000 task ids in one unsigned entry (6.6 MB, under the 8 MiB message limit).
    message = CancelMessage("flood", uuid.uuid4().hex, tuple(str(i) for i in range(950_000)))
    packed, _ = encode(message, Signer(None))
    assert len(packed) < 8 * 1024 * 1024 and len(message.ids) > MAX_IDS_PER_CANCEL
    assert decode(packed, None, Signer(None), "flood") == message  # valid but for its size
    client = redis.Redis.from_url(redis_url)
    client.xadd(keys.cancel_stream("flood"), {keys.F_MESSAGE: packed})
    client.close()
    await wait_until(refused, 20)
    grown = rss_mb(worker.pid) - before
    assert grown < 60, f"the worker grew by {grown:.0f} MB"  # remembered, it was ~190 MB


def listening_address(port: int) -> str | None:
    """The IPv4 address something of this machine listens on at ``port`` (/proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")
@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ((), {}, "127.0.0.1"),
        (("--processes", "2"), {}, "127.0.0.1"),
        ((), {"ASYNCGRAPH_HEALTH_HOST": "0.0.0.0"}, "0.0.0.0"),
    ],
    ids=["default", "supervised", "told"],
)
async def test_the_health_endpoint_binds_loopback_unless_told_otherwise(
    redis_url: str,
    start_worker: StartWorker,
    flags: tuple[str, ...],
    env: dict[str, str],
    expected: str,
) -> None:
    port = free_port()
    start_worker(redis_url, "bind", "--health-port", str(port), *flags, env=env)
    await wait_until(lambda: http_get(port, "/livez")[0] == 200)
    assert listening_address(port) == expected
