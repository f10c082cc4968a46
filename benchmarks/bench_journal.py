"""What a task's call journal costs: the figures behind docs/guide/benchmarks.md "What a
task costs Redis" (its second paragraph).

    python benchmarks/bench_journal.py [--calls 500] [--bound-answer-kb 8]

On one throwaway redis-server, through the journal's own code
(``asyncgraph.models._journal``: ``CallJournal`` on a ``JournalStore``, keys from
``calls_key``, as a worker builds them; NOTE [Call journal]), prints:

1. the latency of ``CallJournal.record`` (one ``EVAL`` on a connection of its own) for
   ``--calls`` calls of a 1 KB answer, recorded by tasks of 10 calls each (a journal holds
   at most ``MAX_RECORDS``), then of ``CallJournal.replay`` on the rerun of those tasks
   (one ``HGET`` and the record's decoding; every read checked to be a hit): median and
   p90, after a warm-up that is not counted;
2. ``MEMORY USAGE <key> SAMPLES 0`` (every field counted) of one task's journal holding
   1 short answer, 10 answers of 1 KB, 256 answers of 1 KB (``MAX_RECORDS``), and one
   filled with answers of ``--bound-answer-kb`` KB until the journal stops keeping them
   (``MAX_TASK_BYTES`` of records), each with the JSON size of its answers (the records'
   bytes, what the journal counts against its bound) and the ratio of the two.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import anyio

from asyncgraph.distributed._redis_server import RedisServer
from asyncgraph.distributed.wire._keys import calls_key
from asyncgraph.models._cache import digest_request
from asyncgraph.models._journal import (
    MAX_RECORDS,
    MAX_TASK_BYTES,
    CallJournal,
    JournalStore,
    encode_record,
)
from asyncgraph.models._types import Completion

QUEUE = "journal"
CLIENT = "0123456789abcdef0123456789abcdef"
CALLS_PER_TASK = 10
TTL_S = 600.0  # the client's wait: longer than the benchmark


def answer(text: str) -> Completion:
    return Completion(
        text,
        model="gpt-4o-mini",
        prompt_tokens=120,
        completion_tokens=max(1, len(text) // 5),
        finish_reason="stop",
    )


SHORT = answer("The capital of France is Paris.")
ONE_KB = answer(" ".join(["word"] * 200))  # 999 characters, some 200 words


def digest(task: str, i: int) -> str:
    """The digest of a task's i-th request, as a model client computes it."""
    messages = [{"role": "user", "content": f"task {task}, question {i}"}]
    request = {"endpoint": "chat", "model": "gpt-4o-mini", "messages": messages, "params": {}}
    return digest_request(request)


def journal(store: JournalStore, task: str, *, rerun: bool) -> CallJournal:
    return CallJournal(store, calls_key(QUEUE, CLIENT, task), ttl_s=TTL_S, rerun=rerun)


def ms(seconds: Sequence[float]) -> str:
    p90 = statistics.quantiles(seconds, n=10)[-1]
    return f"median {statistics.median(seconds) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms"


async def latencies(
    store: JournalStore, calls: int, prefix: str
) -> tuple[list[float], list[float]]:
    """Record ``calls`` 1 KB answers in tasks of ``CALLS_PER_TASK`` calls, then replay
    them on the tasks' reruns: the time of each record and of each replayed read."""
    tasks = [f"{prefix}{t}" for t in range(-(-calls // CALLS_PER_TASK))]
    recorded: list[float] = []
    for t, task in enumerate(tasks):
        first = journal(store, task, rerun=False)
        for i in range(min(CALLS_PER_TASK, calls - t * CALLS_PER_TASK)):
            name = first.name(digest(task, i))
            started = time.perf_counter()
            await first.record(name, ONE_KB)
            recorded.append(time.perf_counter() - started)
    replayed: list[float] = []
    for t, task in enumerate(tasks):
        rerun = journal(store, task, rerun=True)
        for i in range(min(CALLS_PER_TASK, calls - t * CALLS_PER_TASK)):
            name = rerun.name(digest(task, i))
            started = time.perf_counter()
            got = await rerun.replay(name)
            replayed.append(time.perf_counter() - started)
            if got != ONE_KB:
                raise SystemExit(f"replay of {task} call {i} missed: {got!r}")
    return recorded, replayed


async def fill(store: JournalStore, task: str, answers: Sequence[Completion]) -> int:
    """Record ``answers`` as one task's calls (every one kept); how many were."""
    j = journal(store, task, rerun=False)
    for i, completion in enumerate(answers):
        await j.record(j.name(digest(task, i)), completion)
    kept = int(await store.run("HLEN", j.key)) - 1  # less the byte count
    if kept != len(answers):
        raise SystemExit(f"{task}: {kept} of {len(answers)} answers kept")
    return kept


async def fill_to_the_bound(store: JournalStore, task: str, completion: Completion) -> int:
    """Record ``completion`` as one task's calls until the journal keeps no more (its
    record count stops growing: over ``MAX_RECORDS`` or ``MAX_TASK_BYTES``); how many
    it kept."""
    j = journal(store, task, rerun=False)
    kept = 0
    for i in range(MAX_RECORDS + 1):
        await j.record(j.name(digest(task, i)), completion)
        now = int(await store.run("HLEN", j.key)) - 1
        if now == kept:
            return kept
        kept = now
    raise SystemExit(f"{task}: the journal kept {kept} answers, past its bound")


async def memory_line(store: JournalStore, label: str, task: str, completion: Completion) -> str:
    key = calls_key(QUEUE, CLIENT, task)
    used = int(await store.run("MEMORY", "USAGE", key, "SAMPLES", "0"))
    records = int(await store.run("HGET", key, "#bytes"))
    kept = int(await store.run("HLEN", key)) - 1
    each = len(encode_record(completion))
    assert records == kept * each, (records, kept, each)
    plural = "" if kept == 1 else "s"
    return (
        f"memory, {label}: MEMORY USAGE {used:,} bytes; JSON of its {kept} answer{plural} "
        f"{records:,} bytes ({each:,} each); {used / records:.3f}x the JSON"
    )


async def run(url: str, calls: int, bound_answer_kb: int) -> None:
    store = JournalStore(url, 5.0)
    info = await store.run("INFO", "server")
    fields = dict(
        line.split(":", 1) for line in info.decode().splitlines() if ":" in line
    )  # valkey also reports redis_version (the Redis it is compatible with)
    server = (
        f"valkey {fields['valkey_version']}"
        if "valkey_version" in fields
        else f"redis {fields['redis_version']}"
    )
    print(
        f"{server} (redis_version {fields['redis_version']}), CPython "
        f"{platform.python_version()}, asyncio; 1 KB answer = {len(encode_record(ONE_KB)):,} "
        f"bytes of JSON"
    )
    await latencies(store, 100, "warmup")  # not counted
    recorded, replayed = await latencies(store, calls, "latency")
    print(f"record one call (EVAL, 1 KB answer), {calls} calls: {ms(recorded)}")
    print(f"replayed read on a rerun (HGET + decode), {calls} calls, all hits: {ms(replayed)}")

    await fill(store, "short", [SHORT])
    print(await memory_line(store, "1 short answer", "short", SHORT))
    await fill(store, "ten", [ONE_KB] * 10)
    print(await memory_line(store, "10 answers of 1 KB", "ten", ONE_KB))
    await fill(store, "full", [ONE_KB] * MAX_RECORDS)
    print(await memory_line(store, f"{MAX_RECORDS} answers of 1 KB", "full", ONE_KB))
    big = answer("x" * (bound_answer_kb * 1024))
    kept = await fill_to_the_bound(store, "bound", big)
    print(
        await memory_line(
            store,
            f"at the bound ({MAX_TASK_BYTES:,} bytes of records; answers of "
            f"{bound_answer_kb} KB, record {kept + 1} refused)",
            "bound",
            big,
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--bound-answer-kb", type=int, default=8)
    args = parser.parse_args()
    with RedisServer() as server:
        anyio.run(run, server.url, args.calls, args.bound_answer_kb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
