"""The baseline: plain redis-py streams (asyncio), no framework.

Worker: XREADGROUP in batches, XADD the reply and XACK, pipelined per batch.
Client, three ways:

- *round trips* (``round_trips``): one task at a time, its XADD a plain command (not a
  one-command pipeline, which redis-py makes dearer), then a blocking XREAD of the reply;
- *per task* (``call``): each task is a coroutine that XADDs its message and
  awaits a future that one listener (XREAD BLOCK on the client's reply stream)
  resolves: what a hand-written task queue looks like, and what the issue's
  reference figures (5,800 to 9,800 tasks/s) measure;
- *pipelined* (``throughput_pipelined``): all 5,000 XADDs in one round trip and
  no per-task bookkeeping at all: the floor of Redis streams on this machine.

    python benchmarks/dist_raw.py worker URL [concurrency]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid

import redis.asyncio as aioredis

STREAM = "raw:tasks"
GROUP = "raw"


async def worker(url: str, batch: int) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        await client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    except aioredis.ResponseError:
        pass
    name = uuid.uuid4().hex[:8]
    while True:
        result = await client.xreadgroup(GROUP, name, {STREAM: ">"}, count=batch, block=1000)
        if not result:
            continue
        pipe = client.pipeline(transaction=False)
        ids = []
        for entry_id, fields in result[0][1]:
            ids.append(entry_id)
            pipe.xadd(fields[b"reply"], {b"id": fields[b"id"], b"result": fields[b"payload"]})
        pipe.xack(STREAM, GROUP, *ids)
        await pipe.execute()


class Client:
    def __init__(self, url: str) -> None:
        # Concurrent submitters share 64 connections (they wait for a free one).
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30)
        self.client = aioredis.Redis(connection_pool=pool)
        self.reply = f"raw:reply:{uuid.uuid4().hex}"
        self.last = b"0-0"
        self.n = 0

    async def submit(self, count: int) -> list[bytes]:
        """XADD ``count`` tasks: a lone task as a plain command (what a hand-written client
        sends), several in one pipeline."""
        ids = []
        for _ in range(count):
            self.n += 1
            ids.append(str(self.n).encode())
        if count == 1:
            await self.client.xadd(
                STREAM, {b"id": ids[0], b"reply": self.reply, b"payload": b"\x91\xc0"}
            )
            return ids
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.xadd(STREAM, {b"id": task_id, b"reply": self.reply, b"payload": b"\x91\xc0"})
        await pipe.execute()
        return ids

    async def wait(self, count: int) -> None:
        got = 0
        while got < count:
            result = await self.client.xread({self.reply: self.last}, count=1024, block=5000)
            if not result:
                raise TimeoutError("raw baseline: no reply within 5 s")
            entries = result[0][1]
            got += len(entries)
            self.last = entries[-1][0]

    async def round_trips(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            await self.submit(1)
            await self.wait(1)
            times.append(time.perf_counter() - started)
        return times

    async def throughput_pipelined(self, n: int) -> float:
        started = time.perf_counter()
        await self.submit(n)
        await self.wait(n)
        return n / (time.perf_counter() - started)

    async def throughput(self, n: int) -> float:
        """``n`` concurrent submit-and-wait coroutines, resolved by one listener."""
        futures: dict[bytes, asyncio.Future[bytes]] = {}
        loop = asyncio.get_running_loop()

        async def listen() -> None:
            while futures:
                result = await self.client.xread({self.reply: self.last}, count=1024, block=5000)
                if not result:
                    raise TimeoutError("raw baseline: no reply within 5 s")
                for _, fields in result[0][1]:
                    future = futures.pop(fields[b"id"], None)
                    if future is not None:
                        future.set_result(fields[b"result"])
                self.last = result[0][1][-1][0]

        async def call(task_id: bytes) -> bytes:
            future = futures[task_id] = loop.create_future()
            await self.client.xadd(
                STREAM, {b"id": task_id, b"reply": self.reply, b"payload": b"\x91\xc0"}
            )
            return await future

        started = time.perf_counter()
        ids = []
        for _ in range(n):
            self.n += 1
            ids.append(str(self.n).encode())
        calls = [asyncio.ensure_future(call(i)) for i in ids]
        await asyncio.sleep(0)
        await asyncio.gather(listen(), *calls)
        return n / (time.perf_counter() - started)

    async def close(self) -> None:
        await self.client.delete(self.reply)
        await self.client.aclose()


async def latency(url: str, n: int) -> list[float]:
    """Round trips of one task at a time (after 20 warm-up ones)."""
    client = Client(url)
    try:
        await client.round_trips(20)
        return await client.round_trips(n)
    finally:
        await client.close()


async def throughput(url: str, tasks: int, rounds: int = 3) -> float:
    """Per-task throughput, best of ``rounds`` (the figure the CPU-per-task one is taken on)."""
    client = Client(url)
    try:
        await client.round_trips(20)
        return max([await client.throughput(tasks) for _ in range(rounds)])
    finally:
        await client.close()


async def measure(url: str, latency_n: int, tasks: int) -> tuple[list[float], float, float]:
    """Round trips, per-task throughput, pipelined throughput (best of 3)."""
    client = Client(url)
    try:
        await client.round_trips(50)
        times = await client.round_trips(latency_n)
        rate = max([await client.throughput(tasks) for _ in range(3)])
        piped = max([await client.throughput_pipelined(tasks) for _ in range(3)])
        return times, rate, piped
    finally:
        await client.close()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        asyncio.run(worker(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 256))
    else:
        times, rate, piped = asyncio.run(measure(sys.argv[1], 500, 5000))
        print(statistics.median(times) * 1e3, rate, piped)
