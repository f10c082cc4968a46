"""What the replay memory costs Redis: bytes per task, measured on a real server.

    python benchmarks/bench_replay_memory.py [--tasks 20000] [--timeout-s 600]

The replay memory (NOTE [Replays] in ``asyncgraph/distributed/worker/_admission.py``)
keeps its keys under ``asyncgraph:{queue}:ran:``. On a throwaway redis-server
(``ASYNCGRAPH_REDIS_SERVER`` picks the binary) with one worker process:

- *answered*: ``--tasks`` remote no-op nodes, in passes of 2,000, from a client whose
  ``timeout_s`` is ``--timeout-s`` (the memory of a task is kept until its expiry). Once
  all are answered: the memory's keys, the sum of their ``MEMORY USAGE``, and Redis's
  ``used_memory`` before and after deleting them, per task;
- *a lone task*: one pass of one node, then the same;
- *in flight*: ``--in-flight`` nodes sleeping 3 s at once: the memory's ``MEMORY USAGE``
  while they run, per task.

It drives the fleet through its public API only, so the same script measures another
tree: ``PYTHONPATH=/tmp/other-tree python benchmarks/bench_replay_memory.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dist_functions as F  # noqa: E402

import asyncgraph  # noqa: E402
from asyncgraph import Parameter, backward  # noqa: E402
from asyncgraph.distributed import RedisServer, open_redis_executor, wait_for_workers  # noqa: E402

QUEUE = "replaymem"
PASS = 2000


def memory(client: redis.Redis) -> tuple[int, int]:
    """(keys, sum of their MEMORY USAGE) under the queue's replay memory."""
    found = list(client.scan_iter(match=f"asyncgraph:{{{QUEUE}}}:ran:*", count=10_000))
    usage = sum(int(client.memory_usage(key, samples=0) or 0) for key in found)
    return len(found), usage


def used_by_memory(client: redis.Redis) -> int:
    """``used_memory`` freed by deleting the replay memory's keys."""
    before = int(client.info("memory")["used_memory"])
    found = list(client.scan_iter(match=f"asyncgraph:{{{QUEUE}}}:ran:*", count=10_000))
    for start in range(0, len(found), 1000):
        client.delete(*found[start : start + 1000])
    return before - int(client.info("memory")["used_memory"])


async def answered(url: str, n: int, timeout_s: float) -> None:
    async with open_redis_executor(url, queue=QUEUE, timeout_s=timeout_s) as ex:
        for start in range(0, n, PASS):
            leaves = [Parameter(1.0) for _ in range(min(PASS, n - start))]
            await backward([F.Noop.apply(p) for p in leaves], executor=ex)


async def in_flight(url: str, client: redis.Redis, n: int, timeout_s: float) -> tuple[int, int]:
    """The memory while ``n`` tasks run."""
    stream = f"asyncgraph:{{{QUEUE}}}:tasks"
    async with open_redis_executor(url, queue=QUEUE, timeout_s=timeout_s) as ex:
        async with anyio.create_task_group() as tg:
            leaves = [Parameter(1.0) for _ in range(n)]
            tg.start_soon(lambda: backward([F.Sleep.apply(p, 3.0) for p in leaves], executor=ex))
            with anyio.fail_after(60):
                while int(client.xpending(stream, "workers")["pending"]) < n:  # noqa: ASYNC110 (another process's state)
                    await anyio.sleep(0.05)
            await anyio.sleep(0.3)  # their claims' round trip
            return memory(client)


def report(name: str, tasks: int, found: tuple[int, int], freed: int | None) -> None:
    keys, usage = found
    line = (
        f"{name}: {tasks:,} task(s), {keys:,} key(s), MEMORY USAGE {usage:,} B "
        f"= {usage / tasks:.2f} B a task"
    )
    if freed is not None:
        line += f"; used_memory freed by deleting them {freed:,} B = {freed / tasks:.2f} B a task"
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--in-flight", type=int, default=256)
    args = parser.parse_args()
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "asyncgraph", "worker", "--redis", server.url]
        argv += ["--queue", QUEUE, "--import", "dist_functions", "--concurrency", "256"]
        worker = subprocess.Popen(argv, env=env, cwd=HERE)
        try:
            wait_for_workers(server.url, QUEUE, 1)
            info = client.info("server")
            server_name = info.get("server_name", "redis")
            version = info.get(f"{server_name}_version", info["redis_version"])
            print(
                f"{server_name} {version}, asyncgraph from "
                f"{Path(asyncgraph.__file__).parent.parent}, timeout_s {args.timeout_s:g}, "
                f"{'signed' if os.environ.get('ASYNCGRAPH_SECRET') else 'unsigned'}",
                flush=True,
            )
            anyio.run(answered, server.url, 200, args.timeout_s)  # warm up
            used_by_memory(client)
            started = time.perf_counter()
            anyio.run(answered, server.url, args.tasks, args.timeout_s)
            took = time.perf_counter() - started
            print(f"({args.tasks:,} no-op tasks in {took:.1f} s)", flush=True)
            report("answered", args.tasks, memory(client), used_by_memory(client))
            anyio.run(answered, server.url, 1, args.timeout_s)
            report("a lone task", 1, memory(client), used_by_memory(client))
            found: Any = anyio.run(in_flight, server.url, client, args.in_flight, args.timeout_s)
            report("in flight", args.in_flight, found, None)
        finally:
            worker.terminate()
            worker.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
