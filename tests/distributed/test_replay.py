"""A captured signed task, added again to the task stream, does not run again (issue #28, 1),
and the replay memory keeps what a replay check needs and no more (issue #39).

Real redis-server, real workers: a client runs a pass of a slow remote Function, the
test copies its signed task entry with XRANGE meanwhile, as anyone who can read the
stream could, and adds it back later (NOTE [Replays] in ``worker._admission``).
"""

from __future__ import annotations

import functools
import signal
import time
from typing import Any

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import SECRET, StartWorker, wait_until

from asyncgraph import Parameter, RemoteError, Variable, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import ReplyMessage, TaskMessage, decode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._admission import WINDOW_MS, task_memory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

SIGNED = {"ASYNCGRAPH_SECRET": SECRET}
FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")
# Where a test counts runs: a lease a loaded machine does not let lapse (no reclaimed rerun).
STEADY = ("--lease-ms", "10000", "--drain-timeout-s", "1")


def count(client: redis.Redis, key: str) -> int:
    return int(client.llen(key))


def reasons(client: redis.Redis, queue: str) -> list[str]:
    return [f[keys.F_REASON].decode() for _, f in client.xrange(keys.dead_stream(queue))]


async def run_and_capture(
    url: str, queue: str, tag: str, *, timeout_s: float, then: Any = None
) -> tuple[dict[bytes, bytes], TaskMessage]:
    """Run a pass of one ``Sleep`` node, copy its task entry while it runs; after the
    pass, ``await then(entry)`` while the client is still open."""
    client = redis.Redis.from_url(url)
    x = Parameter(2.0, role="x")
    client.set(f"agdist:hold:{tag}", 1)  # still running when a late poll sees it start
    y = F.Held.apply(x, tag)
    captured: dict[bytes, bytes] = {}
    async with open_redis_executor(url, queue=queue, secret=SECRET, timeout_s=timeout_s) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, y, executor=ex))
            await wait_until(lambda: count(client, f"agdist:started:{tag}"))
            ((_, captured),) = client.xrange(keys.task_stream(queue))  # pending: still there
            client.delete(f"agdist:hold:{tag}")
        assert x.grad is not None and x.grad.data == 1.0
        if then is not None:
            await then(captured)
    client.close()
    message = decode(captured[keys.F_MESSAGE], captured[keys.F_SIGNATURE], Signer(SECRET), queue)
    assert isinstance(message, TaskMessage)
    return captured, message


async def test_a_task_replayed_after_its_deadline_is_dead_lettered_expired_unrun(
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, "late", *STEADY, env=SIGNED)
    captured, message = await run_and_capture(redis_url, "late", "late", timeout_s=20)
    client = redis.Redis.from_url(redis_url)

    def redis_ms() -> int:
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # Past its signed expiry and the worker's grace; the new entry's id is fresh.
    await wait_until(lambda: redis_ms() > message.expiry_ms + 600)
    client.xadd(keys.task_stream("late"), captured)  # type: ignore[arg-type]
    await wait_until(lambda: reasons(client, "late") == ["expired"])
    ((_, dead),) = client.xrange(keys.dead_stream("late"))
    assert b"after its signed expiry" in dead[keys.F_ERROR]
    assert count(client, "agdist:started:late") == 1  # ran once: the pass's own run
    client.close()


async def test_a_task_replayed_within_its_deadline_runs_at_most_once(
    redis_url: str, start_worker: StartWorker
) -> None:
    # Two workers: the replay memory lives in Redis, so whichever reads the copy knows.
    start_worker(redis_url, "again", *STEADY, env=SIGNED)
    start_worker(redis_url, "again", *STEADY, env=SIGNED)
    client = redis.Redis.from_url(redis_url)

    async def replay_while_open(entry: dict[bytes, bytes]) -> None:
        client.xadd(keys.task_stream("again"), entry)  # type: ignore[arg-type]
        await wait_until(lambda: reasons(client, "again") == ["replayed"])

    captured, message = await run_and_capture(
        redis_url, "again", "again", timeout_s=60, then=replay_while_open
    )
    # After the client closed, with the hints stripped (nothing says the client is
    # gone): the memory still refuses it.
    signed_only = {k: v for k, v in captured.items() if k in (keys.F_MESSAGE, keys.F_SIGNATURE)}
    client.xadd(keys.task_stream("again"), signed_only)  # type: ignore[arg-type]
    await wait_until(lambda: reasons(client, "again") == ["replayed", "replayed"])
    await anyio.sleep(0.6)  # a run would have started by now
    assert count(client, "agdist:started:again") == 1
    # The memory holds the task's mark, no claim (it is answered), until the end of its
    # expiry's window (60 s, at most WINDOW_MS more, and the grace).
    memory = task_memory("again", message)
    assert memory is not None
    assert client.getbit(memory.answered, memory.bit) == 1
    assert not client.exists(memory.claims)  # the claims of answered tasks are released
    # (Its lower bound leaves 30 s for the steps above on a loaded machine.)
    assert 30_000 < int(client.pttl(memory.answered)) <= 60_000 + WINDOW_MS + 1_500
    assert client.xlen(keys.task_stream("again")) == 0  # every copy was acknowledged
    client.close()


async def test_a_reclaimed_entry_still_runs_after_its_worker_is_killed(
    redis_url: str, start_worker: StartWorker
) -> None:
    """A redelivery of the same entry is no replay: it runs (and is joined once)."""
    first = start_worker(redis_url, "kill", *FAST, env=SIGNED)
    client = redis.Redis.from_url(redis_url)
    x = Parameter(2.0, role="x")
    y = F.Sleep.apply(x, 1.0, "killed")
    async with open_redis_executor(redis_url, queue="kill", secret=SECRET, timeout_s=30) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, y, executor=ex))
            await wait_until(lambda: count(client, "agdist:started:killed"))
            ((entry_id, fields),) = client.xrange(keys.task_stream("kill"))
            first.signal(signal.SIGKILL)  # mid-task, after it claimed the memory
            start_worker(redis_url, "kill", *FAST, env=SIGNED)
        assert ex.stats.completed == 1
    assert x.grad is not None and x.grad.data == 1.0
    assert count(client, "agdist:started:killed") == 2  # the killed run, and the reclaimed one
    assert count(client, "agdist:finished:killed") == 1
    assert reasons(client, "kill") == []
    message = decode(fields[keys.F_MESSAGE], fields[keys.F_SIGNATURE], Signer(SECRET), "kill")
    assert isinstance(message, TaskMessage)
    memory = task_memory("kill", message)
    assert memory is not None and client.getbit(memory.answered, memory.bit) == 1
    assert not client.exists(memory.claims)  # the reclaimed run released the killed one's claim
    # Added again now (without the hints: its client closed), the task is refused: answered.
    signed_only = {k: v for k, v in fields.items() if k in (keys.F_MESSAGE, keys.F_SIGNATURE)}
    client.xadd(keys.task_stream("kill"), signed_only)  # type: ignore[arg-type]
    await wait_until(lambda: reasons(client, "kill") == ["replayed"])
    assert entry_id not in [f[keys.F_TASK] for _, f in client.xrange(keys.dead_stream("kill"))]
    assert count(client, "agdist:started:killed") == 2
    client.close()


async def test_many_tasks_over_two_passes_each_run_once_with_the_memory(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Many tasks, two passes on one client: each task id is new, each runs once."""
    start_worker(redis_url, "busy", "--concurrency", "32", env=SIGNED)
    client = redis.Redis.from_url(redis_url)
    async with open_redis_executor(redis_url, queue="busy", secret=SECRET, timeout_s=30) as ex:
        for _ in range(2):
            leaves = [Parameter(float(i)) for i in range(50)]
            outs = [F.Scale.apply(F.Noop.apply(p), 3.0) for p in leaves]
            await backward(outs, executor=ex)
            assert [p.grad.data for p in leaves] == [3.0] * 50  # type: ignore[union-attr]
        assert ex.stats.completed == 200
    assert reasons(client, "busy") == []
    # One bit per task: 200 marks in a bitmap or two (one per window of expiries the
    # passes' tasks fall in), and no claim left once they were answered.
    answered = list(client.scan_iter(match="asyncgraph:{busy}:ran:*:*:*", count=1000))
    assert 1 <= len(answered) <= 2
    assert sum(int(client.bitcount(key)) for key in answered) == 200
    assert list(client.scan_iter(match="asyncgraph:{busy}:ran:*", count=1000)) == answered
    client.close()


async def test_a_task_cancelled_while_its_memory_is_claimed_does_not_start() -> None:
    """The claim is a round trip between admission and the start: a cancel meanwhile wins."""
    from asyncgraph.distributed import Worker, WorkerConfig
    from asyncgraph.distributed.wire._schema import encode
    from asyncgraph.distributed.worker._registry import build_registry

    worker = Worker(
        WorkerConfig("redis://127.0.0.1:1/0", queue="q"), build_registry(["agdist_functions"])
    )
    slots = worker._ctx.slots  # no Redis: the tasks are taken by hand, nothing is sent
    worker._writer.batching = True
    (name, function), *_ = build_registry(["agdist_functions"]).items()
    message = TaskMessage(
        "q",
        "c" * 32,
        "1",
        name,
        function.fingerprint,
        "backward",
        5000,
        {},
        expiry_ms=int(time.time() * 1000) + 5000,  # no Redis: the worker reads this clock
    )
    packed, signature = encode(message, Signer(None))
    async with slots.runner.serving():
        taken = worker._tasks.admit(
            b"1-0", [keys.F_MESSAGE, packed, keys.F_SIGNATURE, signature], 1
        )
        assert taken is not None
        worker._cancels.cancel("c" * 32, ["1"])  # a cancel message read meanwhile
        assert not worker._tasks.start(*taken, 1, 0)  # claimed, not answered
        assert ("c" * 32, "1") not in slots.running
    (settled,) = worker._writer._outgoing
    assert settled.outcome == "cancelled"
    assert settled.memory == taken[1].memory and not settled.answered  # its claim released


def hand_written_task(task_id: str, ttl_ms: int, expiry_ms: int) -> dict[bytes, bytes]:
    """A signed task entry of ``agdist_functions.Sleep`` (0 s) from client ``"c" * 32``."""
    from asyncgraph.distributed.wire._payload import backward_payload
    from asyncgraph.distributed.wire._schema import encode
    from asyncgraph.distributed.worker._registry import build_registry

    registered = build_registry(["agdist_functions"])["agdist_functions:Sleep"]
    node = F.Sleep.apply(Parameter(1.0), 0.0, "absurd").grad_fn
    assert node is not None
    message = TaskMessage(
        "absurd",
        "c" * 32,
        task_id,
        registered.name,
        registered.fingerprint,
        "backward",
        ttl_ms,
        backward_payload(node, (Variable(1.0),)),
        expiry_ms=expiry_ms,
    )
    packed, signature = encode(message, Signer(SECRET))
    return {keys.F_MESSAGE: packed, keys.F_SIGNATURE: signature}


async def test_a_task_whose_expiry_or_ttl_is_absurd_is_refused_unrun(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Issue #39: a ttl near 2**63 made Redis refuse the memory's expiry, and the task ran
    unrecorded. Now such a task is refused at admission, with a reply, and never runs."""
    start_worker(redis_url, "absurd", *FAST, env=SIGNED)
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    stream = keys.task_stream("absurd")
    client.xadd(stream, hand_written_task("1", 5000, 2**63 - 1))  # type: ignore[arg-type]
    client.xadd(stream, hand_written_task("2", 2**63 - 1, now_ms + 5000))  # type: ignore[arg-type]
    client.xadd(stream, hand_written_task("3", 5000, now_ms + 5000))  # type: ignore[arg-type]  # sane
    replies = keys.reply_stream("absurd", "c" * 32)
    await wait_until(lambda: client.xlen(replies) == 3)
    answers = {}
    for _, fields in client.xrange(replies):
        reply = decode(fields[keys.F_MESSAGE], fields[keys.F_SIGNATURE], Signer(SECRET), "absurd")
        assert isinstance(reply, ReplyMessage)
        answers[reply.id] = reply.error
    assert answers["3"] is None  # the sane one ran
    assert answers["1"] is not None and answers["1"].kind == "invalid"
    assert "further ahead of the Redis clock than its ttl" in answers["1"].message
    assert answers["2"] is not None and answers["2"].kind == "invalid"
    assert "must be at most 604800000" in answers["2"].message
    assert count(client, "agdist:started:absurd") == 1
    assert reasons(client, "absurd") == ["malformed", "malformed"]
    # Nothing of the refused ones was recorded; the sane one is marked answered.
    memory = task_memory("absurd", decode_task(hand_written_task("3", 5000, now_ms + 5000)))
    assert memory is not None and client.getbit(memory.answered, memory.bit) == 1
    assert len(list(client.scan_iter(match="asyncgraph:{absurd}:ran:*"))) == 1
    client.close()


def decode_task(fields: dict[bytes, bytes]) -> TaskMessage:
    message = decode(fields[keys.F_MESSAGE], fields[keys.F_SIGNATURE], Signer(SECRET), "absurd")
    assert isinstance(message, TaskMessage)
    return message


async def test_a_task_whose_claim_redis_refuses_is_refused_not_run(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Issue #39: a failed replay-memory write refuses the task (it ran unrecorded before).
    Redis refuses the claim here because its key holds a string (WRONGTYPE), as it would
    refuse it at maxmemory (OOM): the caller gets Redis's words, the function never runs."""
    start_worker(redis_url, "refused", *FAST, env=SIGNED)
    client = redis.Redis.from_url(redis_url)
    x = Parameter(2.0, role="x")
    async with open_redis_executor(redis_url, queue="refused", secret=SECRET, timeout_s=30) as ex:
        # Spoil the claims key of every window the task's expiry can fall in.
        seconds, _ = client.time()
        first = (int(seconds) * 1000 + 30_000) // WINDOW_MS
        for window in range(first - 1, first + 3):
            client.set(keys.ran_claims_key("refused", ex.client_id, window), b"not a hash")
        with pytest.raises(RemoteError, match="Redis refused to record task") as caught:
            await backward(F.Sleep.apply(x, 0.0, "refused"), executor=ex)
    assert "WRONGTYPE" in str(caught.value) and "not run" in str(caught.value)
    assert count(client, "agdist:started:refused") == 0
    assert x.grad is None
    client.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), 7 * 86400 + 1, float("inf")])
async def test_a_client_timeout_workers_would_refuse_is_refused_at_open(timeout_s: float) -> None:
    """The bound of a task's ttl (7 days) is the client's too: said before any Redis call."""
    with pytest.raises(ValueError, match=r"timeout_s must be > 0 and at most 604800 s"):
        async with open_redis_executor("redis://127.0.0.1:1/0", timeout_s=timeout_s):
            pass  # pragma: no cover


def test_the_reply_transaction_marks_releases_and_keeps_the_reply_for_the_timeout() -> None:
    """What settles an answered task, in its one MULTI: its reply, its mark (once per bitmap
    its expiry), its claim released, its reply stream kept for the client's timeout."""
    from asyncgraph.distributed import Worker, WorkerConfig
    from asyncgraph.distributed.worker._outcomes import Held, Memory
    from asyncgraph.distributed.worker._registry import build_registry

    worker = Worker(
        WorkerConfig("redis://127.0.0.1:1/0", queue="q"), build_registry(["agdist_functions"])
    )
    replies = worker._writer.replies
    client = "c" * 32
    batch = []
    for task_id, bit in (("1", 1), ("2", 2)):
        held = Held(f"1-{bit}".encode())
        settled = replies.refused(held, client, task_id, "whatever")
        settled.memory = Memory("claims", task_id, "bits", bit, 123_456)
        settled.answered, settled.reply_ttl_s = True, 61
        batch.append(settled)
    skipped = replies.settled(Held(b"1-3"), "client_gone")
    skipped.memory = Memory("claims", "3", "bits", 3, 123_456)  # released, not answered
    commands = worker._writer._transaction([*batch, skipped])
    names = [c[0] for c in commands]
    assert names == [
        *("MULTI", "XADD", "SETBIT", "HDEL", "XADD", "SETBIT", "HDEL", "HDEL"),
        *("PEXPIREAT", "EXPIRE", "XACK", "XDEL", "EXEC"),
    ]
    assert ["SETBIT", "bits", 2, 1] in commands and ["HDEL", "claims", "3"] in commands
    assert ["PEXPIREAT", "bits", 123_456] in commands
    assert ["EXPIRE", keys.reply_stream("q", client), 61] in commands
    assert keys.reply_ttl_s(60_000) == 61 and keys.reply_ttl_s(None) == keys.REPLY_TTL_S
