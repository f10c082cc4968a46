"""Which Redis client serves the hot path: ours (asyncgraph.resp), coredis, redis-py asyncio.

    python benchmarks/bench_redis_clients.py [--quick]

Needs ``pip install -e ".[bench-redis]"`` (hiredis, coredis): redis-py is measured with
hiredis's C parser, as its users install it (``redis[hiredis]``); the run says whether
hiredis is active. One throwaway redis-server, three workloads the fleet does, each
client on each event loop it supports (redis-py's asyncio client does not run on trio):

- round trip: one ``XADD`` + ``XLEN`` pipeline, awaited (median and p99, microseconds);
- throughput: ``XADD`` of 64-byte entries, 256 per pipeline, 40,000 in all (entries/s);
- read: ``XRANGE`` of 256 entries of 1 KiB, decoded (reads/s);
- CPU: this process's CPU seconds per 1,000 operations of the three (from /proc;
  the redis-server's share is the same for all clients and left out).

Ratios are printed against ours, in one run. A figure counts when it holds in two runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import anyio

from asyncgraph.distributed import RedisServer
from asyncgraph.resp import Pool, parse_redis_url

ENTRY = b"x" * 64
READ_ENTRY = b"y" * 1024


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class Ours:
    name = "asyncgraph.resp"

    def __init__(self, url: str) -> None:
        self.pool = Pool(parse_redis_url(url), timeout_s=5)

    async def __aenter__(self) -> Ours:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.aclose()

    async def round_trip(self, key: str) -> None:
        await self.pool.pipeline([["XADD", key, "*", "m", ENTRY], ["XLEN", key]])

    async def add_many(self, key: str, n: int) -> None:
        await self.pool.pipeline([["XADD", key, "*", "m", ENTRY] for _ in range(n)])

    async def read(self, key: str, n: int) -> int:
        return len(await self.pool.execute("XRANGE", key, "-", "+", "COUNT", n))


class CoRedis:
    name = "coredis"

    def __init__(self, url: str) -> None:
        import coredis

        self.client: Any = coredis.Redis.from_url(url, decode_responses=False)

    async def __aenter__(self) -> CoRedis:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)

    async def round_trip(self, key: str) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {"m": ENTRY})
            pipe.xlen(key)

    async def add_many(self, key: str, n: int) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for _ in range(n):
                pipe.xadd(key, {"m": ENTRY})

    async def read(self, key: str, n: int) -> int:
        return len(await self.client.xrange(key, count=n))


class RedisPy:
    name = "redis-py asyncio"

    def __init__(self, url: str) -> None:
        import redis.asyncio

        self.client: Any = redis.asyncio.Redis.from_url(url)

    async def __aenter__(self) -> RedisPy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def round_trip(self, key: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(key, {"m": ENTRY})
        pipe.xlen(key)
        await pipe.execute()

    async def add_many(self, key: str, n: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for _ in range(n):
            pipe.xadd(key, {"m": ENTRY})
        await pipe.execute()

    async def read(self, key: str, n: int) -> int:
        return len(await self.client.xrange(key, count=n))


async def measure(client_type: Any, url: str, quick: bool) -> dict[str, float]:
    trips, batches, reads = (500, 60, 300) if quick else (3000, 160, 1500)
    key = f"bench:{client_type.name}:{os.getpid()}:{time.monotonic_ns()}"
    async with client_type(url) as client:
        for _ in range(50):  # warm up: connections, code paths
            await client.round_trip(key)
        times = []
        cpu0 = cpu_s()
        for _ in range(trips):
            started = time.perf_counter()
            await client.round_trip(key)
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(batches):
            await client.add_many(key, 256)
        add_rate = batches * 256 / (time.perf_counter() - started)
        read_key = key + ":read"
        await Ours(url).pool.pipeline(
            [["XADD", read_key, "*", "m", READ_ENTRY] for _ in range(256)]
        )
        started = time.perf_counter()
        for _ in range(reads):
            assert await client.read(read_key, 256) == 256
        read_rate = reads / (time.perf_counter() - started)
        cpu = cpu_s() - cpu0
    ordered = sorted(times)
    return {
        "rt_med_us": statistics.median(ordered) * 1e6,
        "rt_p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
        "add_per_s": add_rate,
        "read_per_s": read_rate,
        "cpu_ms_per_1000": cpu / (trips + batches * 256 + reads) * 1e6,
    }


def run(client_type: Any, url: str, backend: str, quick: bool) -> dict[str, float]:
    result: dict[str, float] = anyio.run(measure, client_type, url, quick, backend=backend)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    import redis.utils

    hiredis = redis.utils.HIREDIS_AVAILABLE
    print(f"redis-py {redis.__version__}, hiredis parser {'ACTIVE' if hiredis else 'MISSING'}")
    if not hiredis:
        print('  install it (pip install -e ".[bench-redis]"): without it redis-py is slower')
    cases: list[tuple[Any, str]] = [
        (Ours, "asyncio"),
        (Ours, "trio"),
        (CoRedis, "asyncio"),
        (CoRedis, "trio"),
        (RedisPy, "asyncio"),
    ]
    results: dict[tuple[str, str], dict[str, float]] = {}
    with RedisServer() as server:
        for _round in range(2):  # interleaved: every client sees the same machine
            for client_type, backend in cases:
                try:
                    got = run(client_type, server.url, backend, args.quick)
                except ImportError as exc:
                    print(f"{client_type.name}: skipped ({exc})")
                    continue
                key = (client_type.name, backend)
                best = results.get(key)
                if best is None or got["rt_med_us"] < best["rt_med_us"]:
                    results[key] = got
    print()
    print(
        f"{'client':18} {'loop':8} {'rt med us':>9} {'rt p99 us':>9} {'XADD/s':>9} "
        f"{'XRANGE/s':>9} {'CPU ms/1000 ops':>15}"
    )
    for (name, backend), r in results.items():
        print(
            f"{name:18} {backend:8} {r['rt_med_us']:9.0f} {r['rt_p99_us']:9.0f} "
            f"{r['add_per_s']:9.0f} {r['read_per_s']:9.0f} {r['cpu_ms_per_1000']:15.2f}"
        )
    ours = results[("asyncgraph.resp", "asyncio")]
    print()
    for (name, backend), r in results.items():
        if name == "asyncgraph.resp":
            continue
        print(
            f"{name} ({backend}) vs ours (asyncio): round trip {r['rt_med_us'] / ours['rt_med_us']:.2f}x, "
            f"XADD throughput {r['add_per_s'] / ours['add_per_s']:.2f}x, XRANGE "
            f"{r['read_per_s'] / ours['read_per_s']:.2f}x, CPU per op "
            f"{r['cpu_ms_per_1000'] / ours['cpu_ms_per_1000']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
