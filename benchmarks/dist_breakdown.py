"""Where a remote node's time and CPU go.

The figures behind docs/guide/benchmarks.md, "Where the time goes".

    python benchmarks/dist_breakdown.py [--passes 500]

On one throwaway redis-server, prints:

1. the round trip of one command with asyncgraph's RESP client (``PING`` and ``XADD``)
   on an idle server, no worker running;
2. one remote async no-op node's round trip, broken down (asyncio, 1 worker, medians
   over ``--passes`` passes): ``backward()`` to the task's submission, the XADD that
   sends it, until the listener reads its reply, until the node resumes, until the pass
   ends. The steps are timed by wrapping three ``TaskChannel`` methods in this process
   (a diagnostic, not an API: they are private and may change);
3. 3 x 5,000 remote no-op nodes (``bench_distributed``'s throughput run), with an asyncio
   client, then a trio one: the CPU per task of the client, the worker and redis-server
   (from /proc), and the time the client's garbage collector spent (``gc.callbacks``),
   by generation.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_distributed as bench  # noqa: E402
import dist_functions as F  # noqa: E402

from asyncgraph import Parameter, backward  # noqa: E402
from asyncgraph.distributed import _channel  # noqa: E402
from asyncgraph.distributed._redis_server import RedisServer  # noqa: E402
from asyncgraph.resp import Pool, parse_redis_url  # noqa: E402

STEPS = ("start", "submit", "flush", "flushed", "reply", "resumed", "end")


async def idle_round_trips(url: str, n: int = 3000) -> dict[str, float]:
    pool = Pool(parse_redis_url(url), timeout_s=5)
    medians = {}
    for command in (["PING"], ["XADD", "breakdown:idle", "*", "f", "v"]):
        times = []
        for _ in range(n):
            started = time.perf_counter()
            await pool.execute(*command)
            times.append(time.perf_counter() - started)
        medians[command[0]] = statistics.median(times[n // 5 :]) * 1e6
    await pool.aclose()
    return medians


def instrument(events: list[tuple[str, float]]) -> None:
    """Record when each step of a task happens, in this process."""
    channel = _channel.TaskChannel
    send_and_wait, flush, on_reply = channel.send_and_wait, channel._flush, channel._on_reply

    async def timed_send_and_wait(self: Any, *args: Any) -> Any:
        events.append(("submit", time.perf_counter()))
        pending = await send_and_wait(self, *args)
        events.append(("resumed", time.perf_counter()))
        return pending

    async def timed_flush(self: Any, **kwargs: Any) -> None:
        events.append(("flush", time.perf_counter()))
        await flush(self, **kwargs)
        events.append(("flushed", time.perf_counter()))

    def timed_on_reply(self: Any, fields: list[Any]) -> None:
        events.append(("reply", time.perf_counter()))
        on_reply(self, fields)

    channel.send_and_wait = timed_send_and_wait  # type: ignore[method-assign]
    channel._flush = timed_flush  # type: ignore[method-assign]
    channel._on_reply = timed_on_reply  # type: ignore[method-assign]


def breakdown(url: str, passes: int) -> list[tuple[str, float]]:
    """Median time of each step, over the passes whose steps came in the usual order."""
    events: list[tuple[str, float]] = []
    instrument(events)

    async def body(executor: Any) -> None:
        for _ in range(passes + 100):
            y = F.Noop.apply(Parameter(1.0))
            events.append(("start", time.perf_counter()))
            await backward(y, executor=executor)
            events.append(("end", time.perf_counter()))

    bench.run_remote(url, body)
    passes_seen: list[list[tuple[str, float]]] = []
    current: list[tuple[str, float]] | None = None
    for name, at in events:
        if name == "start":
            current = []
        if current is not None:
            current.append((name, at))
            if name == "end":
                passes_seen.append(current)
                current = None
    usual = [p for p in passes_seen[100:] if tuple(n for n, _ in p) == STEPS]
    print(f"{len(usual)} of {passes} passes in the usual order ({' -> '.join(STEPS)})")
    return [
        (f"{STEPS[i - 1]} -> {STEPS[i]}", statistics.median(p[i][1] - p[i - 1][1] for p in usual))
        for i in range(1, len(STEPS))
    ] + [("total", statistics.median(p[-1][1] - p[0][1] for p in usual))]


def own_cpu() -> float:
    return sum(os.times()[:2])


def cpu_per_task(
    url: str,
    worker_pid: int,
    redis_pid: int,
    backend: str = "asyncio",
    tasks: int = 5000,
    rounds: int = 3,
) -> None:
    spent: Counter[int] = Counter()
    counts: Counter[int] = Counter()
    started_at = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started_at[0] = time.perf_counter()
        else:
            spent[info["generation"]] += time.perf_counter() - started_at[0]
            counts[info["generation"]] += 1

    bench.run_remote(url, lambda ex: bench.graph_throughput(ex, 2000, rounds=1), backend)  # warm up
    before = [own_cpu(), *(bench.cpu_of([pid]) - own_cpu() for pid in (worker_pid, redis_pid))]
    gc.callbacks.append(on_gc)
    try:
        bench.run_remote(url, lambda ex: bench.graph_throughput(ex, tasks, rounds=rounds), backend)
    finally:
        gc.callbacks.remove(on_gc)
    after = [own_cpu(), *(bench.cpu_of([pid]) - own_cpu() for pid in (worker_pid, redis_pid))]
    n = tasks * rounds
    client, worker, server = ((a - b) / n * 1e6 for a, b in zip(after, before, strict=True))
    total = sum(spent.values())
    print(
        f"{backend} client, {n:,} remote no-op nodes ({rounds} passes of {tasks:,}), CPU a task: client "
        f"{client:.0f} us (garbage collection {total / n * 1e6:.0f} us of it, {total:.2f} s in "
        f"all), worker {worker:.0f} us, redis-server {server:.0f} us"
    )
    for generation in sorted(spent):
        print(
            f"  generation {generation}: {counts[generation]} collections, "
            f"{spent[generation]:.3f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=500)
    args = parser.parse_args()
    with RedisServer() as server:
        url = server.url
        for command, us in anyio.run(idle_round_trips, url).items():
            print(f"idle server, one {command} with asyncgraph's client: {us:.0f} us (median)")
        redis_pid = server._proc.pid if server._proc is not None else None
        assert redis_pid is not None
        workers = bench.asyncgraph_workers(url, 1, 256)
        with bench.processes(workers, bench.workers_alive(url, 1)) as (worker,):
            for backend in ("asyncio", "trio"):
                cpu_per_task(url, worker.pid, redis_pid, backend)
            print("one remote async no-op node, asyncio, 1 worker, medians:")
            for step, seconds in breakdown(url, args.passes):
                print(f"  {step:20s} {seconds * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
