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
from typing import Any

import redis.asyncio as aioredis

STREAM = "raw:tasks"
GUARDED_STREAM = "raw:guarded:tasks"  # its own stream: both workers may run at once
GROUP = "raw"
SECRET = b"a benchmark's shared secret, 32+ bytes long"
SLEEP = b"sleep:"  # a task whose payload is ``sleep:<seconds>`` sleeps that long (wide pass)
TTL_MS = 600_000  # a claim is kept for the task's ttl (the client's timeout)


def mac(*parts: bytes) -> bytes:
    """HMAC-SHA256 of the parts (each length-prefixed: no ambiguity between them), in hex."""
    h = hmac.new(SECRET, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.hexdigest().encode()


async def worker(url: str, batch: int, guarded: bool = False) -> None:
    # Its sleeping tasks reply on their own: they share 64 connections, as the client's do.
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=30)
    client = aioredis.Redis(connection_pool=pool)
    stream = GUARDED_STREAM if guarded else STREAM
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except aioredis.ResponseError:
        pass
    name = uuid.uuid4().hex[:8]
    sleepers = Sleepers(client, stream, guarded)
    writer = asyncio.create_task(sleepers.write_replies())
    while not writer.done():
        if len(sleepers.running) >= batch:  # at most ``batch`` sleeping tasks held at once
            await asyncio.wait(sleepers.running, return_when=asyncio.FIRST_COMPLETED)
        free = batch - len(sleepers.running)
        result = await client.xreadgroup(GROUP, name, {stream: ">"}, count=free, block=1000)
        if not result:
            continue
        entries = result[0][1]
        ids = [entry_id for entry_id, _ in entries]
        if guarded:
            entries = await verified_and_claimed(client, entries)
        # A sleeping task runs on its own, and replies and is acknowledged when it is done
        # (the wide pass); the rest of the batch (and what was refused) at once.
        later = {entry_id for entry_id, fields in entries if sleepers.start(entry_id, fields)}
        entries = [e for e in entries if e[0] not in later]
        ids = [entry_id for entry_id in ids if entry_id not in later]
        if not ids:
            continue
        pipe = client.pipeline(transaction=False)
        for _, fields in entries:
            pipe.xadd(fields[b"reply"], reply_fields(fields, guarded))
        pipe.xack(stream, GROUP, *ids)
        await pipe.execute()
    writer.result()


async def verified_and_claimed(client: aioredis.Redis, entries: list[Any]) -> list[Any]:
    """The entries whose HMAC checks out (checked first: the others are acknowledged,
    never run) and whose claim is new (one pipelined round trip per batch)."""
    verified = [
        (entry_id, fields)
        for entry_id, fields in entries
        if hmac.compare_digest(
            mac(fields[b"id"], fields[b"reply"], fields[b"payload"]), fields[b"sig"]
        )
    ]
    claim = client.pipeline(transaction=False)
    for entry_id, fields in verified:
        claim.set(
            b"raw:ran:" + fields[b"reply"] + b":" + fields[b"id"], entry_id, nx=True, px=TTL_MS
        )
    claimed = await claim.execute()
    return [e for e, new in zip(verified, claimed, strict=True) if new]


class Sleepers:
    """A worker's sleeping tasks (the wide pass): each sleeps on its own; the replies of
    those done meanwhile, and their acks, go in one pipelined round trip (tasks that
    finish together reply together)."""

    def __init__(self, client: aioredis.Redis, stream: str, guarded: bool) -> None:
        self.client, self.stream, self.guarded = client, stream, guarded
        self.running: set[asyncio.Task[None]] = set()
        self.done: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.some_done = asyncio.Event()

    def start(self, entry_id: bytes, fields: dict[bytes, bytes]) -> bool:
        """Start a sleeping task; False if this task is not one."""
        if not fields[b"payload"].startswith(SLEEP):
            return False
        task = asyncio.create_task(self.sleep(entry_id, fields))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return True

    async def sleep(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        await asyncio.sleep(float(fields[b"payload"][len(SLEEP) :]))
        self.done.append((entry_id, fields))
        self.some_done.set()

    async def write_replies(self) -> None:
        while True:
            await self.some_done.wait()
            self.some_done.clear()
            done, self.done = self.done, []
            pipe = self.client.pipeline(transaction=False)
            for _, fields in done:
                pipe.xadd(fields[b"reply"], reply_fields(fields, self.guarded))
            pipe.xack(self.stream, GROUP, *(entry_id for entry_id, _ in done))
            await pipe.execute()


def reply_fields(fields: dict[bytes, bytes], guarded: bool) -> dict[bytes, bytes]:
    """A task's reply: its id and result (its payload), signed when guarded."""
    reply = {b"id": fields[b"id"], b"result": fields[b"payload"]}
    if guarded:
        reply[b"sig"] = mac(fields[b"id"], fields[b"payload"])
    return reply


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

    def task(self, task_id: bytes, payload: bytes = b"\x91\xc0") -> dict[bytes, bytes | str]:
        """A task entry's fields (signed when guarded)."""
        fields: dict[bytes, bytes | str] = {
            b"id": task_id,
            b"reply": self.reply,
            b"payload": payload,
        }
        if self.guarded:
            fields[b"sig"] = mac(task_id, self.reply_bytes, payload)
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

    async def listen(self, futures: dict[bytes, asyncio.Future[bytes]]) -> None:
        """Resolve each task's future with its checked reply, until none waits."""
        while futures:
            result = await self.client.xread({self.reply: self.last}, count=1024, block=5000)
            if not result:
                raise TimeoutError("raw baseline: no reply within 5 s")
            for _, fields in result[0][1]:
                future = futures.pop(fields[b"id"], None)
                if future is not None:
                    future.set_result(self.check(fields))
            self.last = result[0][1][-1][0]

    async def throughput(self, n: int) -> float:
        """``n`` concurrent submit-and-wait coroutines, resolved by one listener."""
        futures: dict[bytes, asyncio.Future[bytes]] = {}
        loop = asyncio.get_running_loop()

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
        await asyncio.gather(self.listen(futures), *calls)
        return n / (time.perf_counter() - started)

    async def wide(self, n: int, seconds: float) -> float:
        """``n`` concurrent tasks that each sleep ``seconds`` on the workers, sent in one
        pipeline and joined by one listener: the wall time over ``seconds`` (the critical
        path)."""
        futures: dict[bytes, asyncio.Future[bytes]] = {}
        loop = asyncio.get_running_loop()
        payload = SLEEP + str(seconds).encode()

        started = time.perf_counter()
        # All sent in one pipelined round trip (as asyncgraph's flusher sends a ready level).
        pipe = self.client.pipeline(transaction=False)
        for _ in range(n):
            self.n += 1
            task_id = str(self.n).encode()
            futures[task_id] = loop.create_future()
            pipe.xadd(self.stream, self.task(task_id, payload))
        waiting = list(futures.values())
        await pipe.execute()
        await asyncio.gather(self.listen(futures), *waiting)
        return (time.perf_counter() - started) / seconds

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


async def wide(
    url: str, n: int = 256, seconds: float = 0.2, guarded: bool = False
) -> tuple[float, float]:
    """The wide pass (``Client.wide``), after a small warm-up one: its wall time over
    ``seconds``, and this process's CPU seconds a task (``time.process_time()``)."""
    client = Client(url, guarded)
    try:
        await client.wide(16, 0.01)
        cpu = time.process_time()
        ratio = await client.wide(n, seconds)
        return ratio, (time.process_time() - cpu) / n
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
