"""What one remote task costs the worker, without Redis: the figures behind
docs/guide/benchmarks.md, "Where the time goes".

    python benchmarks/worker_path.py [--tasks 20000]

Prints, in this process:

1. the worker's CPU for one async no-op task, in batches of 64 as a read hands them over,
   and one at a time (a read, a pass of the event loop, a reply: as in a round trip):
   admission (decode, checks), the task that runs it with the model layer's task hook
   (installed in every worker the CLI starts), the reply and its transaction's commands
   (not sent: no Redis, so none of the network's cost);
2. parsing one task-stream entry of an XREADGROUP reply: asyncgraph.resp's Python parser
   against hiredis's C parser (which the client uses when hiredis is installed);
3. the CPU one wake-up of this process costs (``asyncio.sleep(0.005)`` in a loop): the
   price of every blocking read's return on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import timeit
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_functions as F

import asyncgraph.models  # noqa: F401  (as `asyncgraph worker` does: the model layer's task hook)
from asyncgraph import LocalExecutor, Parameter
from asyncgraph.distributed import Worker, WorkerConfig
from asyncgraph.distributed._executor import RedisExecutor
from asyncgraph.distributed._yield import let_ready_tasks_run
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS
from asyncgraph.distributed.wire._payload import backward_payload
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._registry import build_registry
from asyncgraph.resp import Pool, parse_redis_url
from asyncgraph.resp._hiredis_protocol import _HiredisReader
from asyncgraph.resp._protocol import Reader

BATCH = 64
NOWHERE = "redis://127.0.0.1:1/0"  # never connected to


def task_entries(n: int) -> list[tuple[bytes, list[bytes]]]:
    """``n`` stream entries of a real client's task message for ``dist_functions.Noop``."""
    pool = Pool(parse_redis_url(NOWHERE), timeout_s=1)
    client = RedisExecutor(
        pool,
        "bench",
        signer=Signer(None),
        timeout_s=600,
        local=LocalExecutor(),
        limits=DEFAULT_LIMITS,
        run_id=None,
    )
    node = F.Noop.apply(Parameter(1.0)).grad_fn
    assert node is not None
    now_ms = int(time.time() * 1000)
    entries = []
    for i in range(n):
        task_id, _, packed, signature = client._encode(
            F.Noop, "backward", backward_payload(node, (None,)), node.ctx, dict
        )
        fields = [
            keys.F_MESSAGE,
            packed,
            keys.F_SIGNATURE,
            signature,
            keys.F_CLIENT_HINT,
            client.client_id.encode(),
            keys.F_TASK_HINT,
            task_id.encode(),
        ]
        entries.append((f"{now_ms}-{i}".encode(), fields))
    return entries


async def worker_cpu_per_task(n: int, batch: int = BATCH) -> float:
    entries = task_entries(n)
    worker = Worker(
        WorkerConfig(NOWHERE, queue="bench", concurrency=n), build_registry(["dist_functions"])
    )
    worker._writer.batching = True  # the replies are built, never sent
    slots = worker._ctx.slots
    async with slots.runner.serving():
        best = float("inf")
        for _ in range(3):
            started = time.process_time()
            for start in range(0, n, batch):
                taken = [worker._tasks.admit(e, f, 1) for e, f in entries[start : start + batch]]
                admitted = [a for a in taken if a is not None]
                worker._tasks.claims(admitted)  # the replay memory's commands: built, not sent
                for held, task in admitted:
                    worker._tasks.start(held, task, 1, 0)  # as if claimed, never answered
                await let_ready_tasks_run()
                await let_ready_tasks_run()
                worker._writer._transaction(worker._writer._outgoing)
                worker._writer._outgoing.clear()
                slots.held.clear()
            best = min(best, (time.process_time() - started) / n)
    return best


def parse_per_entry() -> dict[str, float]:
    def bulk(data: bytes) -> bytes:
        return b"$%d\r\n%b\r\n" % (len(data), data)

    (_, fields), *_ = task_entries(1)
    entry = b"*2\r\n" + bulk(b"1795575131132-0") + b"*%d\r\n" % len(fields)
    entry += b"".join(bulk(f) for f in fields)
    wire = b"*1\r\n*2\r\n" + bulk(b"asyncgraph:{bench}:tasks") + b"*%d\r\n" % BATCH + entry * BATCH
    figures = {}
    for reader_class in (Reader, _HiredisReader):

        def parse(reader_class: type = reader_class) -> object:
            reader = reader_class()
            reader.cap, reader.max_items = DEFAULT_LIMITS.max_message_bytes, 256
            reader.feed(wire)
            return reader.next_reply()

        runs = timeit.repeat(parse, number=500, repeat=5)
        figures[reader_class.__name__] = min(runs) / 500 / BATCH
    return figures


def wake_up_cpu(n: int = 200) -> float:
    async def sleeps() -> float:
        started = time.process_time()
        for _ in range(n):
            await asyncio.sleep(0.005)
        return (time.process_time() - started) / n

    return asyncio.run(sleeps())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    args = parser.parse_args()
    per_task = anyio.run(worker_cpu_per_task, args.tasks)
    alone = anyio.run(worker_cpu_per_task, args.tasks, 1)
    print(
        f"worker CPU for one async no-op task, in process: {per_task * 1e6:.1f} us in batches "
        f"of {BATCH}, {alone * 1e6:.1f} us one at a time (best of 3 x {args.tasks:,})"
    )
    parse = parse_per_entry()
    print(
        f"parsing one task entry of an XREADGROUP reply: Python parser "
        f"{parse['Reader'] * 1e6:.2f} us, hiredis {parse['_HiredisReader'] * 1e6:.2f} us"
    )
    print(
        f"one wake-up of this process (asyncio.sleep(0.005) in a loop): "
        f"{wake_up_cpu() * 1e6:.0f} us of CPU"
    )


if __name__ == "__main__":
    main()
