"""``asyncgraph worker --processes N``: restarts, dead letters after max attempts, health, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, http_get, wait_for_workers, wait_until

from asyncgraph import Parameter, RemoteError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed._redis_server import RedisServer, free_port
from asyncgraph.distributed.wire import _keys as keys

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc.read().decode())


@pytest.mark.parametrize(
    "anyio_backend", ["asyncio"]
)  # the supervisor's behaviour, not the client's
async def test_supervisor_restarts_workers_and_poison_task_is_dead_lettered(
    redis_url: str, start_worker: StartWorker
) -> None:
    port = free_port()
    supervisor = start_worker(
        redis_url,
        "super",
        "--processes",
        "2",
        "--lease-ms",
        "1000",
        "--max-attempts",
        "2",
        "--drain-timeout-s",
        "2",
        "--health-port",
        str(port),
        "--health-host",
        "127.0.0.1",
        wait=False,
    )
    wait_for_workers(redis_url, "super", 2)
    x = Parameter(1.0, role="x")
    async with open_redis_executor(redis_url, queue="super", timeout_s=120) as ex:
        with pytest.raises(RemoteError, match="delivered 3 times") as info:
            await backward(F.Crash.apply(x), executor=ex)
        assert info.value.function == "Crash"
        # The fleet is whole again and serves other work.
        y = F.Scale.apply(x, 3.0)
        await backward(y, executor=ex)
        assert x.grad is not None and x.grad.data == 3.0

    client = redis.Redis.from_url(redis_url)
    crashes = [int(p) for p in client.lrange("agdist:crashes", 0, -1)]
    assert len(crashes) == 2 and len(set(crashes)) == 2
    ((_, dead),) = client.xrange(keys.dead_stream("super"))
    assert dead[keys.F_REASON] == b"max_attempts"
    client.close()

    with anyio.fail_after(120):  # a deadline: two children restarted on a loaded machine
        while True:
            status, body = await anyio.to_thread.run_sync(get, port, "/healthz")
            if status == 200 and json.loads(body)["alive"] == 2:
                break
            await anyio.sleep(0.1)
    health = json.loads(body)
    assert health["restarts"] >= 2
    wanted = [
        "asyncgraph_worker_processes 2",
        'asyncgraph_worker_tasks_total{outcome="dead_letter"} 1',
        'asyncgraph_worker_tasks_total{outcome="ok"} 1',
    ]
    with anyio.fail_after(120):  # children write their snapshots about once a second
        while True:
            status, metrics = await anyio.to_thread.run_sync(get, port, "/metrics")
            if status == 200 and all(line in metrics for line in wanted):
                break
            await anyio.sleep(0.1)

    supervisor.signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(supervisor.proc.wait, 60) == 0
    for pid in health["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_supervisor_readiness_follows_the_children_and_argv_holds_no_url(
    start_worker: StartWorker, redis_server_binary: None
) -> None:
    port = free_port()
    with RedisServer() as server:
        url = server.url.replace("redis://", "redis://default:not-in-argv@")
        await anyio.to_thread.run_sync(
            lambda: redis.Redis.from_url(server.url).config_set("requirepass", "not-in-argv")
        )
        start_worker(
            url,
            "ready",
            "--processes",
            "2",
            "--lease-ms",
            "1000",
            "--drain-timeout-s",
            "1",
            "--health-port",
            str(port),
            "--health-host",
            "127.0.0.1",
            wait=False,
        )
        await wait_until(lambda: http_get(port, "/readyz")[0] == 200)
        status, body = http_get(port, "/healthz")
        health = json.loads(body)
        assert status == 200 and health["ready"] == 2
        for pid in health["pids"]:
            with open(f"/proc/{pid}/cmdline", "rb") as f:  # noqa: ASYNC230
                argv = f.read().split(b"\0")
            assert b"--redis" not in argv and not any(b"not-in-argv" in a for a in argv)

        server.stop()  # the children lose Redis: not ready, but alive
        await wait_until(lambda: http_get(port, "/readyz")[0] == 503)
        status, body = http_get(port, "/readyz")
        assert "redis unreachable" in json.loads(body)["status"]
        assert http_get(port, "/livez")[0] == 200
        server.start()
        await anyio.to_thread.run_sync(
            lambda: redis.Redis.from_url(server.url).config_set("requirepass", "not-in-argv")
        )
        await wait_until(lambda: http_get(port, "/readyz")[0] == 200)


@pytest.mark.slow
def test_zero_processes_is_refused() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgraph",
            "worker",
            "--processes",
            "0",
            "--import",
            "asyncgraph.text",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--processes must be >= 1, got 0" in done.stderr
