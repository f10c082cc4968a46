"""arq at tuned settings (many jobs per worker, 1 ms result polling), for comparison.

python benchmarks/dist_arq.py worker URL
"""

from __future__ import annotations

import sys
import time
from typing import Any

from arq import create_pool
from arq.connections import RedisSettings
from arq.worker import run_worker

URL = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "worker" else "redis://127.0.0.1:6379/0"


async def noop(ctx: dict[str, Any]) -> int:
    return 1


class WorkerSettings:
    functions = [noop]  # noqa: RUF012
    redis_settings = RedisSettings.from_dsn(URL)
    max_jobs = 256
    poll_delay = 0.001
    keep_result = 60
    handle_signals = True


async def measure(url: str, latency_n: int, tasks: int) -> tuple[list[float], float]:
    pool = await create_pool(RedisSettings.from_dsn(url))
    try:
        times = []
        for i in range(latency_n + 20):
            started = time.perf_counter()
            job = await pool.enqueue_job("noop")
            assert job is not None
            await job.result(timeout=10, poll_delay=0.0005)
            if i >= 20:
                times.append(time.perf_counter() - started)
        best = 0.0
        for _ in range(2):
            started = time.perf_counter()
            jobs = [await pool.enqueue_job("noop") for _ in range(tasks)]
            for job in jobs:
                assert job is not None
                await job.result(timeout=60, poll_delay=0.001)
            best = max(best, tasks / (time.perf_counter() - started))
        return times, best
    finally:
        await pool.aclose()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        run_worker(WorkerSettings)  # type: ignore[arg-type]
    else:  # measure URL LATENCY_N TASKS: print "times... rate" (run in a subprocess, bounded)
        import asyncio

        times, rate = asyncio.run(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        print(" ".join(map(str, [*times, rate])))
