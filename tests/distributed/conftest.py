"""Real worker processes (``python -m asyncgraph worker``) against the real Redis of the suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from agdist_helpers import StartWorker, WorkerProcess, wait_for_workers


@pytest.fixture
def start_worker() -> Iterator[StartWorker]:
    """``start_worker(url, queue, *flags, wait=True)`` starts a worker; all are stopped after the test."""
    started: list[WorkerProcess] = []

    def start(
        url: str, queue: str, *extra: str, wait: bool = True, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        before = 0
        if wait:
            from asyncgraph.distributed.wire._keys import workers_hash

            client = redis.Redis.from_url(url)
            before = int(client.hlen(workers_hash(queue)))
            client.close()
        worker = WorkerProcess(url, queue, *extra, env=env)
        started.append(worker)
        if wait:
            wait_for_workers(url, queue, before + 1)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def shared_fleet(redis_server_url: str) -> Iterator[str]:
    """Two workers on queue 'shared' for tests that only need a working fleet (not flushed)."""
    queue = "shared"
    client = redis.Redis.from_url(redis_server_url)
    for key in client.scan_iter(match=f"asyncgraph:{{{queue}}}:*"):
        client.delete(key)
    client.close()
    workers = [WorkerProcess(redis_server_url, queue, "--concurrency", "64") for _ in range(2)]
    try:
        wait_for_workers(redis_server_url, queue, 2)
        yield queue
    finally:
        for worker in workers:
            worker.stop()
