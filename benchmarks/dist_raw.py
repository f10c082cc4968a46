"""The baselines: hand-written redis-py streams (asyncio), no framework, two of them.

*plain*: the worker reads with XREADGROUP in batches, then XADDs the replies and XACKs,
pipelined per batch; nothing is checked. The floor.

*guarded*: the same, with the guarantees asyncgraph's fleet gives (``--guarded``), written
as directly as redis-py allows: every task carries an HMAC-SHA256 of its id, reply
stream and payload under a shared secret, which the worker checks (``hmac.compare_digest``)
before anything else; then, per batch, one pipelined round trip of ``SET NX PX`` claims
(one key per task, ``raw:ran:<client>:<task id>``, kept for the task's ttl): a task runs
only if its claim is new, so a copy of it added again (a replay, a resend) does not run
twice. Replies are signed the same way and the client checks each one before using it.

Client, three ways:

- *round trips* (``round_trips``): one task at a time, its XADD a plain command (not a
  one-command pipeline, which redis-py makes dearer), then a blocking XREAD of the reply;
- *per task* (``call``): each task is a coroutine that XADDs its message and
  awaits a future that one listener (XREAD BLOCK on the client's reply stream)
  resolves: what a hand-written task queue looks like, and what the issue's
  reference figures (5,800 to 9,800 tasks/s) measure;
- *pipelined* (``throughput_pipelined``): all 5,000 XADDs in one round trip and
  no per-task bookkeeping at all: the floor of Redis streams on this machine.

    python benchmarks/dist_raw.py worker URL [concurrency] [--guarded]
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import statistics
import sys
import time
import uuid

import redis.asyncio as aioredis

STREAM = "raw:tasks"
GUARDED_STREAM = "raw:guarded:tasks"  # its own stream: both workers may run at once
GROUP = "raw"
SECRET = b"a benchmark's shared secret, 32+ bytes long"
TTL_MS = 600_000  # a claim is kept for the task's ttl (the client's timeout)


def mac(*parts: bytes) -> bytes:
    """HMAC-SHA256 of the parts (each length-prefixed: no ambiguity between them), in hex."""
    h = hmac.new(SECRET, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.hexdigest().encode()


async def worker(url: str, batch: int, guarded: bool = False) -> None:
    client = aioredis.Redis.from_url(url)
    stream = GUARDED_STREAM if guarded else STREAM
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except aioredis.ResponseError:
        pass
    name = uuid.uuid4().hex[:8]
    while True:
        result = await client.xreadgroup(GROUP, name, {stream: ">"}, count=batch, block=1000)
        if not result:
            continue
        entries = result[0][1]
        ids = [entry_id for entry_id, _ in entries]
        if guarded:
            # Checked first: an entry whose HMAC does not match is acknowledged, never run.
            verified = [
                (entry_id, fields)
                for entry_id, fields in entries
                if hmac.compare_digest(
                    mac(fields[b"id"], fields[b"reply"], fields[b"payload"]), fields[b"sig"]
                )
            ]
            # Claimed before it runs: one round trip per batch.
            claim = client.pipeline(transaction=False)
            for entry_id, fields in verified:
                claim.set(
                    b"raw:ran:" + fields[b"reply"] + b":" + fields[b"id"],
                    entry_id,
                    nx=True,
                    px=TTL_MS,
                )
            claimed = await claim.execute()
            entries = [e for e, new in zip(verified, claimed, strict=True) if new]
        pipe = client.pipeline(transaction=False)
        for _, fields in entries:
            reply = {b"id": fields[b"id"], b"result": fields[b"payload"]}
            if guarded:
                reply[b"sig"] = mac(fields[b"id"], fields[b"payload"])
            pipe.xadd(fields[b"reply"], reply)
        pipe.xack(stream, GROUP, *ids)
        await pipe.execute()


class Client:
    def __init__(self, url: str, guarded: bool = False) -> None:
        # Concurrent submitters share 64 connections (they wait for a free one).
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30)
        self.client = aioredis.Redis(connection_pool=pool)
        self.reply = f"raw:reply:{uuid.uuid4().hex}"
        self.reply_bytes = self.reply.encode()
        self.guarded = guarded
        self.stream = GUARDED_STREAM if guarded else STREAM
        self.last = b"0-0"
        self.n = 0

    def task(self, task_id: bytes) -> dict[bytes, bytes | str]:
        """A task entry's fields (signed when guarded)."""
        fields: dict[bytes, bytes | str] = {
            b"id": task_id,
            b"reply": self.reply,
            b"payload": b"\x91\xc0",
        }
        if self.guarded:
            fields[b"sig"] = mac(task_id, self.reply_bytes, b"\x91\xc0")
        return fields

    def check(self, fields: dict[bytes, bytes]) -> bytes:
        """A reply's result, once its HMAC checks out (when guarded)."""
        if self.guarded and not hmac.compare_digest(
            mac(fields[b"id"], fields[b"result"]), fields.get(b"sig", b"")
        ):
            raise ValueError(f"raw baseline: a reply with a bad HMAC: {fields!r}")
        return fields[b"result"]

    async def submit(self, count: int) -> list[bytes]:
        """XADD ``count`` tasks: a lone task as a plain command (what a hand-written client
        sends), several in one pipeline."""
        ids = []
        for _ in range(count):
            self.n += 1
            ids.append(str(self.n).encode())
        if count == 1:
            await self.client.xadd(self.stream, self.task(ids[0]))
            return ids
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.xadd(self.stream, self.task(task_id))
        await pipe.execute()
        return ids

    async def wait(self, count: int) -> None:
        got = 0
        while got < count:
            result = await self.client.xread({self.reply: self.last}, count=1024, block=5000)
            if not result:
                raise TimeoutError("raw baseline: no reply within 5 s")
            entries = result[0][1]
            for _, fields in entries:
                self.check(fields)
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
                        future.set_result(self.check(fields))
                self.last = result[0][1][-1][0]

        async def call(task_id: bytes) -> bytes:
            future = futures[task_id] = loop.create_future()
            await self.client.xadd(self.stream, self.task(task_id))
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


async def latency(url: str, n: int, guarded: bool = False) -> list[float]:
    """Round trips of one task at a time (after 20 warm-up ones)."""
    client = Client(url, guarded)
    try:
        await client.round_trips(20)
        return await client.round_trips(n)
    finally:
        await client.close()


async def throughput(url: str, tasks: int, rounds: int = 3, guarded: bool = False) -> float:
    """Per-task throughput, best of ``rounds`` (the figure the CPU-per-task one is taken on)."""
    client = Client(url, guarded)
    try:
        await client.round_trips(20)
        return max([await client.throughput(tasks) for _ in range(rounds)])
    finally:
        await client.close()


async def measure(
    url: str, latency_n: int, tasks: int, guarded: bool = False
) -> tuple[list[float], float, float]:
    """Round trips, per-task throughput, pipelined throughput (best of 3)."""
    client = Client(url, guarded)
    try:
        await client.round_trips(50)
        times = await client.round_trips(latency_n)
        rate = max([await client.throughput(tasks) for _ in range(3)])
        piped = max([await client.throughput_pipelined(tasks) for _ in range(3)])
        return times, rate, piped
    finally:
        await client.close()


if __name__ == "__main__":
    guarded = "--guarded" in sys.argv
    argv = [a for a in sys.argv if a != "--guarded"]
    if argv[1] == "worker":
        asyncio.run(worker(argv[2], int(argv[3]) if len(argv) > 3 else 256, guarded))
    else:
        times, rate, piped = asyncio.run(measure(argv[1], 500, 5000, guarded))
        print(statistics.median(times) * 1e3, rate, piped)
