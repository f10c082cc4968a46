"""``asyncgraph status`` against a real fleet: workers, queue, an injected dead letter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import pytest
import redis
from agdist_helpers import StartWorker, wait_until

from asyncgraph.distributed.wire import _keys as keys

QUEUE = "status"


def status(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncgraph", "status", "--redis", url, "--queue", QUEUE, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.anyio
async def test_status_shows_the_workers_and_a_dead_letter(
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, QUEUE, "--concurrency", "7")
    start_worker(redis_url, QUEUE, "--concurrency", "7")
    client = redis.Redis.from_url(redis_url)
    # A message no worker can read: dead-lettered as malformed.
    client.xadd(keys.task_stream(QUEUE), {b"m": b"\xc1 not msgpack"})
    await wait_until(lambda: client.xlen(keys.dead_stream(QUEUE)) >= 1)
    client.close()

    done = status(redis_url, "--json")
    assert done.returncode == 0, done.stderr
    reading = json.loads(done.stdout)
    assert reading["alive"] == 2 and len(reading["workers"]) == 2
    for worker in reading["workers"]:
        assert worker["alive"] and worker["concurrency"] == 7 and worker["draining"] is False
        assert isinstance(worker["pid"], int) and worker["host"] and worker["version"]
        assert worker["in_flight"] == 0
    assert reading["dead_letters"] == 1
    assert reading["latest_dead_letters"][0]["reason"] == "malformed"
    assert reading["pending"] == 0 and reading["depth"] == 0  # dead-lettered, then removed

    text = status(redis_url)
    assert text.returncode == 0, text.stderr
    assert f"queue '{QUEUE}'" in text.stdout and "2 worker(s) alive" in text.stdout
    assert text.stdout.count("0/7 in flight") == 2
    assert "dead letters: 1" in text.stdout and "malformed" in text.stdout


def test_status_of_an_unknown_queue_or_an_unreachable_redis_is_clear(redis_url: str) -> None:
    unknown = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "status", "--redis", redis_url, "--queue", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1
    assert "queue 'nope'" in unknown.stdout and "unknown" in unknown.stdout
    down = status("redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert down.stderr.startswith("error: ") and "check --redis" in down.stderr
    assert "Traceback" not in down.stderr


def test_a_wrong_password_is_one_clear_line_that_does_not_show_the_password(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.acl_setuser(
        "statususer", enabled=True, passwords=["+right-password"], commands=["+@all"], keys=["*"]
    )
    try:
        host = redis_url.split("//", 1)[1].split("/", 1)[0]
        done = status(f"redis://statususer:wrong-password@{host}/0")
        assert done.returncode == 1
        assert done.stderr.startswith("error: Redis at redis://statususer:***@")
        assert "WRONGPASS" in done.stderr and "check the user name and password" in done.stderr
        assert "Traceback" not in done.stderr and "wrong-password" not in done.stderr
        # The password in the query (redis-py's form) and in the environment variable.
        env = {
            **os.environ,
            "ASYNCGRAPH_REDIS_URL": f"redis://statususer@{host}/0?password=right-password",
        }
        for extra in (["--json"], []):
            shown = subprocess.run(
                [sys.executable, "-m", "asyncgraph", "status", "--queue", QUEUE, *extra],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            assert shown.returncode == 1  # an unknown queue, read with the right password
            assert "password=***" in shown.stdout
            assert "right-password" not in shown.stdout + shown.stderr
    finally:
        client.acl_deluser("statususer")
        client.close()


def test_escape_sequences_stored_in_redis_are_shown_escaped(redis_url: str) -> None:
    # Anyone who can write to Redis chooses what status prints: a worker entry of theirs.
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    expiry = seconds * 1000 + micros // 1000 + 60_000
    host = "evil\x1b]0;pwned\x07\x1b[2J\r\u009b2Jhost"
    client.hset(keys.workers_hash(QUEUE), "w\x1b[31m1", expiry)
    client.hset(keys.workers_info_hash(QUEUE), "w\x1b[31m1", json.dumps({"host": host}))
    client.close()
    text = status(redis_url)
    assert "\x1b" not in text.stdout and "\x07" not in text.stdout and "\r" not in text.stdout
    assert "\u009b" not in text.stdout  # a C1 control (CSI on some terminals) too
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\x9b2Jhost" in text.stdout
    assert "w\\x1b[31m1" in text.stdout


@pytest.mark.anyio
async def test_the_rate_counts_settled_tasks_on_every_redis_version(
    redis_server_url: str, shared_fleet: str
) -> None:
    # Redis 6.2 (the oldest supported, bundled for the tests) has no entries-read in
    # XINFO GROUPS: the rate comes from what each worker says it settled.
    import agdist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.distributed._status import fleet_status

    async def settled() -> int:
        reading = await fleet_status(redis_server_url, shared_fleet)
        return sum(w["settled"] for w in reading["workers"])

    before = await settled()
    leaves = [Parameter(float(i)) for i in range(64)]
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward([F.Noop.apply(p) for p in leaves], executor=ex)
    with anyio.fail_after(15):  # workers publish their count with their heartbeat
        while await settled() < before + 64:  # noqa: ASYNC110 (a poll of Redis)
            await anyio.sleep(0.1)
    assert await settled() == before + 64


@pytest.mark.anyio
async def test_every_reading_while_tasks_flow_shows_their_rate(
    redis_server_url: str, shared_fleet: str
) -> None:
    # The issue: `status --watch` read 0.0 tasks/s with 64 tasks in flight. Each worker
    # publishes what it settled per second since its previous status, so any reading taken
    # while tasks flow shows a rate, however its interval falls against the heartbeats.
    import agdist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.distributed._status import fleet_status

    chains = []
    for i in range(8):
        node = Parameter(float(i))
        for _ in range(170):  # 8 tasks settled every 50 ms, for about 8.5 s
            node = F.Nap.apply(node, 0.05)
        chains.append(node)
    rates: list[float] = []
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=60) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(chains, executor=ex))
            await anyio.sleep(4.5)  # past every worker's first status of the pass
            for _ in range(6):
                rates.append((await fleet_status(redis_server_url, shared_fleet))["tasks_per_s"])
                await anyio.sleep(0.5)
    assert all(rate > 20 for rate in rates), rates  # about 160 a second flow
