"""saq at tuned settings (concurrency 128, completion polled every 0.5 ms), for comparison.

python benchmarks/dist_saq.py worker URL
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import redis.asyncio as aioredis
from saq import Worker
from saq.queue.redis import RedisQueue as Queue


async def noop(ctx: dict[str, Any]) -> int:
    return 1


def make_queue(url: str) -> Queue:
    # saq's default pool is too small for high concurrency ("Too many connections").
    return Queue(aioredis.from_url(url, max_connections=1024), max_concurrent_ops=256)


async def worker(url: str) -> None:
    queue = make_queue(url)
    await Worker(queue, functions=[noop], concurrency=128, dequeue_timeout=1).start()


async def wait_done(queue: Queue, jobs: list[Any], timeout_s: float) -> None:
    """Poll job status every 0.5 ms (saq's pub/sub completion wait hangs at times here)."""
    deadline = time.monotonic() + timeout_s
    for job in jobs:
        while True:
            await job.refresh()
            if job.completed:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("saq: jobs not done in time")
            await asyncio.sleep(0.0005)


async def measure(url: str, latency_n: int, tasks: int) -> tuple[list[float], float]:
    queue = make_queue(url)
    await queue.connect()
    try:
        times = []
        for i in range(latency_n + 20):
            started = time.perf_counter()
            job = await queue.enqueue("noop")
            await wait_done(queue, [job], 10)
            if i >= 20:
                times.append(time.perf_counter() - started)
        best = 0.0
        for _ in range(2):
            started = time.perf_counter()
            jobs = [await queue.enqueue("noop") for _ in range(tasks)]
            await wait_done(queue, jobs, 60)
            best = max(best, tasks / (time.perf_counter() - started))
        return times, best
    finally:
        await queue.disconnect()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        asyncio.run(worker(sys.argv[2]))
    else:  # measure URL LATENCY_N TASKS: print "times... rate" (run in a subprocess, bounded)
        times, rate = asyncio.run(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        print(" ".join(map(str, [*times, rate])))
