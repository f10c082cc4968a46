"""``local_fleet`` and ``live_workers``: a fleet on someone else's Redis leaves the other
workers' heartbeat entries alone, counts only its own workers as started, runs in its
own session, and leaves nothing behind."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import anyio
import pytest
import redis

from asyncgraph.distributed._fleet import live_workers, local_fleet
from asyncgraph.distributed.wire import _keys as keys


def _children_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and text.encode() in cmdline:
            found.append(int(entry.name))
    return found


def test_a_fleet_on_an_existing_redis_leaves_other_workers_entries(redis_url: str) -> None:
    queue = f"ag-fleet-test-{uuid.uuid4().hex[:8]}"
    workers = keys.workers_hash(queue)
    client = redis.Redis.from_url(redis_url)
    try:
        now_s, _ = client.time()
        # Another machine's worker (alive for a minute) and one that died 10 s ago (workers
        # sweep entries a minute past their expiry; this one stays, and is not alive).
        client.hset(
            workers, mapping={"elsewhere-1": (now_s + 60) * 1000, "gone-2": (now_s - 10) * 1000}
        )
        assert anyio.run(live_workers, redis_url, queue) == 1
        with local_fleet(1, ["asyncgraph.text"], redis_url=redis_url, queue=queue):
            # Started means: its own worker announced itself (the live entry did not count).
            assert anyio.run(live_workers, redis_url, queue) == 2
            (supervisor,) = _children_mentioning(queue)
            assert os.getsid(supervisor) == supervisor != os.getsid(0)  # its own session
        assert client.hexists(workers, "elsewhere-1") and client.hexists(workers, "gone-2")
        assert _children_mentioning(queue) == []
    finally:
        client.close()


def test_live_workers_of_an_unreachable_redis_raise_a_clear_error() -> None:
    from asyncgraph import RemoteConnectionError
    from asyncgraph.distributed._redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RemoteConnectionError, match=f"cannot reach Redis at {url}"):
        anyio.run(live_workers, url, "grads")
