"""Redis Sentinel (issue #15 point 1): clients and workers follow a failover.

Real processes on loopback: a master, a replica and three sentinels. The master is
killed in the middle of a pass: the pass completes with the right gradients or fails
with a clear RemoteConnectionError within its deadline, and the next pass runs on the
new master, served by the same workers. Nothing hangs.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, check_limiter_and_cache, wait_for_workers

from asyncgraph import Parameter, RemoteConnectionError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed._redis_server import find_redis_server, free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SERVICE = "agmaster"


def ping(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def wait(predicate: object, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class SentinelSet:
    """A master, a replica and three sentinels watching them."""

    def __init__(self, directory: Path) -> None:
        binary = find_redis_server()
        self.master, self.replica = free_port(), free_port()
        self.sentinels = [free_port() for _ in range(3)]
        plain = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        for name in ("master", "replica"):  # the full sync writes an RDB file in each
            (directory / name).mkdir()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.procs[self.master] = subprocess.Popen(
            [binary, "--port", str(self.master), *plain, "--dir", str(directory / "master")],
            stdout=subprocess.DEVNULL,
        )
        self.procs[self.replica] = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.replica),
                *plain,
                "--dir",
                str(directory / "replica"),
                "--replicaof",
                "127.0.0.1",
                str(self.master),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait(lambda: ping(self.master) and ping(self.replica), what="master and replica")
        for port in self.sentinels:
            conf = directory / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.procs[port] = subprocess.Popen(
                [binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL
            )
        wait(lambda: all(ping(p) for p in self.sentinels), what="the sentinels")
        wait(
            lambda: all(self.replicas_known(p) for p in self.sentinels),
            30,
            what="the sentinels to see the replica",
        )

    def replicas_known(self, sentinel: int) -> bool:
        try:
            client = redis.Redis(port=sentinel, socket_timeout=0.5)
            return bool(client.execute_command("SENTINEL", "REPLICAS", SERVICE))
        except redis.RedisError:
            return False

    def master_port(self) -> int | None:
        for sentinel in self.sentinels:
            try:
                client = redis.Redis(port=sentinel, socket_timeout=0.5)
                host_port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                return int(host_port[1])
            except (redis.RedisError, TypeError, IndexError):
                continue
        return None

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def kill_master(self) -> None:
        self.procs[self.master].kill()
        self.procs[self.master].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def sentinel_set(tmp_path: Path, redis_server_binary: None) -> Iterator[SentinelSet]:
    started = SentinelSet(tmp_path)
    yield started
    started.stop()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_clients_and_workers_follow_a_failover(
    sentinel_set: SentinelSet, start_worker: StartWorker
) -> None:
    url = sentinel_set.url
    master_url = f"redis://127.0.0.1:{sentinel_set.master}/0"
    start_worker(url, "failover", "--lease-ms", "1000", "--redis-timeout-s", "2", wait=False)
    await anyio.to_thread.run_sync(wait_for_workers, master_url, "failover", 1)
    x = Parameter(1.0)
    async with open_redis_executor(url, queue="failover", timeout_s=30, redis_timeout_s=2) as ex:
        await backward(F.Scale.apply(x, 2.0), executor=ex)
    assert x.grad is not None and x.grad.data == 2.0
    await check_limiter_and_cache(url, "sentinel")

    # Kill the master while a pass runs.
    leaves = [Parameter(float(i + 1)) for i in range(4)]
    outcome: list[object] = []
    started = time.monotonic()
    async with open_redis_executor(url, queue="failover", timeout_s=30, redis_timeout_s=2) as ex:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await backward([F.Nap.apply(p, 2.0) for p in leaves], executor=ex)
                    outcome.append("completed")
                except RemoteConnectionError as exc:
                    outcome.append(exc)

            tg.start_soon(run)
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(sentinel_set.kill_master)
    assert time.monotonic() - started < 35  # within its deadline: nothing hangs
    (result,) = outcome
    if result == "completed":
        assert [p.grad.data for p in leaves] == [1.0] * 4  # type: ignore[union-attr]
    else:
        assert "Redis" in str(result)

    await anyio.to_thread.run_sync(
        lambda: wait(
            lambda: sentinel_set.master_port() == sentinel_set.replica, 30, what="failover"
        )
    )
    # The next pass, on the new master, with the same worker.
    y = Parameter(3.0)
    async with open_redis_executor(url, queue="failover", timeout_s=30, redis_timeout_s=2) as ex:
        with anyio.fail_after(30):
            await backward(F.Scale.apply(y, 2.0), executor=ex)
    assert y.grad is not None and y.grad.data == 2.0
    await check_limiter_and_cache(url, "sentinel-after")
