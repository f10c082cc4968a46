"""``asyncgraph status`` against a real fleet: workers, queue, an injected dead letter."""

from __future__ import annotations

import json
import subprocess
import sys

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
