"""What the fleet costs Redis: commands and Redis CPU per task, and per idle worker.

    python benchmarks/bench_redis_cost.py [--tasks 5000] [--workers 2]

Measured with ``INFO commandstats`` (calls and ``usec``, Redis's own CPU time per
command) on a throwaway redis-server, around:

- a backward of ``--tasks`` remote no-op nodes (one pass, fanned out) on ``--workers``
  worker processes: commands per task, Redis CPU microseconds per task, by command;
- ``--idle-s`` seconds with the same workers and no work: commands per second and Redis
  CPU per second of one idle worker (heartbeats, lease checks, blocking reads);
- ``--round-trips`` passes of one remote no-op node each, one after the other: the
  median round trip and the commands each one sends (what a lone task costs).

Then an extrapolation (printed as such): how many tasks per second and idle workers one
Redis primary's core serves before it is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dist_functions as F  # noqa: E402

from asyncgraph import Parameter, backward  # noqa: E402
from asyncgraph.distributed import RedisServer, open_redis_executor, wait_for_workers  # noqa: E402

QUEUE = "cost"


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, usec) so far."""
    stats = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
    }


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def delta(
    after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    out = {}
    for name, (calls, usec) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if calls - c0:
            out[name] = (calls - c0, usec - u0)
    return out


async def sequential(url: str, client: redis.Redis, n: int) -> tuple[float, dict[str, float]]:
    """``n`` passes of one remote no-op node, one after the other: the median round trip,
    and the commands per pass (``INFO`` itself left out)."""
    async with open_redis_executor(url, queue=QUEUE, timeout_s=120) as ex:
        for _ in range(50):  # warm up
            await backward([F.Noop.apply(Parameter(1.0))], executor=ex)
        before = commandstats(client)
        times = []
        for _ in range(n):
            started = time.perf_counter()
            await backward([F.Noop.apply(Parameter(1.0))], executor=ex)
            times.append(time.perf_counter() - started)
        after = commandstats(client)
    per_pass = {
        name: calls / n
        for name, (calls, _) in delta(after, before).items()
        if name != "info" and calls >= n / 2
    }
    return statistics.median(times), per_pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--round-trips", type=int, default=400)
    args = parser.parse_args()
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        env = dict(os.environ, PYTHONPATH=str(HERE))
        argv = [sys.executable, "-m", "asyncgraph", "worker", "--redis", server.url]
        argv += ["--queue", QUEUE, "--import", "dist_functions", "--concurrency", "256"]
        workers = [subprocess.Popen(argv, env=env, cwd=HERE) for _ in range(args.workers)]
        try:
            wait_for_workers(server.url, QUEUE, args.workers)

            async def run(n: int) -> None:
                async with open_redis_executor(server.url, queue=QUEUE, timeout_s=120) as ex:
                    leaves = [Parameter(1.0) for _ in range(n)]
                    await backward([F.Noop.apply(p) for p in leaves], executor=ex)

            anyio.run(run, 200)  # warm up
            round_trip_s, per_pass = anyio.run(sequential, server.url, client, args.round_trips)
            time.sleep(1.0)
            assert server._proc is not None
            pid = server._proc.pid
            before, cpu0 = commandstats(client), process_cpu_s(pid)
            started = time.perf_counter()
            anyio.run(run, args.tasks)
            busy_s = time.perf_counter() - started
            busy, busy_cpu = delta(commandstats(client), before), process_cpu_s(pid) - cpu0
            before, cpu0 = commandstats(client), process_cpu_s(pid)
            time.sleep(args.idle_s)
            idle, idle_cpu = delta(commandstats(client), before), process_cpu_s(pid) - cpu0
            version = client.info("server")["redis_version"]
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(30)
    calls = sum(c for c, _ in busy.values())
    usec = sum(u for _, u in busy.values())
    idle_calls = sum(c for c, _ in idle.values()) / args.idle_s / args.workers
    idle_usec = sum(u for _, u in idle.values()) / args.idle_s / args.workers
    print(f"redis-server {version}, {args.workers} workers")
    print(
        f"busy: {args.tasks:,} tasks in {busy_s:.2f} s (includes the client's open and "
        f"close): {calls / args.tasks:.2f} commands and {usec / args.tasks:.1f} us of Redis "
        f"CPU per task in commands (commandstats), {busy_cpu / args.tasks * 1e6:.1f} us of "
        f"redis-server process CPU per task with its networking (/proc) (measured)"
    )
    for name, (c, u) in sorted(busy.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"  {name:22s} {c / args.tasks:7.3f} calls/task  {u / args.tasks:6.1f} us/task")
    print(
        f"idle: {idle_calls:.2f} commands and {idle_usec:.1f} us of Redis CPU per second per "
        f"worker in commands, {idle_cpu / args.idle_s / args.workers * 1e6:.0f} us/s of process "
        f"CPU (measured)"
    )
    for name, (c, u) in sorted(idle.items(), key=lambda kv: -kv[1][1])[:6]:
        print(
            f"  {name:22s} {c / args.idle_s / args.workers:6.2f} calls/s  "
            f"{u / args.idle_s / args.workers:6.1f} us/s"
        )
    print(
        f"one at a time: {args.round_trips} passes of one remote no-op node, median round trip "
        f"{round_trip_s * 1e3:.3f} ms, {sum(per_pass.values()):.2f} commands a pass:"
    )
    for name, calls in sorted(per_pass.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {name:22s} {calls:7.3f} calls/pass")
    per_task = busy_cpu / args.tasks * 1e6
    # An idle Redis's process CPU is mostly its own cron (hz 10), whatever the workers do:
    # idle workers are counted by their commands' CPU, doubled for their networking.
    per_idle = max(2 * idle_usec, 0.001)
    print(
        f"extrapolated (not measured): one Redis core is busy at about {1e6 / per_task:,.0f} "
        f"tasks/s (process CPU per task above), or with about {1e6 / per_idle:,.0f} idle "
        f"workers (their commands' CPU, doubled for networking); plan for half of that "
        f"(replication, persistence, other clients)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
