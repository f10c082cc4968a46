"""Exactly one bill per model call across crashes (issue #27): the call journal.

A worker SIGKILLed after its task's model call returned and before its reply: the
rerun on another worker replays the recorded answer (no new HTTP request), the
gradient is the one a crash-free run gives, and the usage says one request, replayed.
See NOTE [Call journal] in ``asyncgraph.models._journal``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import agdist_functions as F
import pytest
import redis
from agdist_helpers import (
    FAST,
    SECRET,
    NumberedServer,
    StartWorker,
    http_get,
    kill_after_the_call_then_rerun,
)

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed._redis_server import free_port
from asyncgraph.distributed.wire._keys import calls_key
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.models import OpenAIChat, track_usage
from asyncgraph.models._journal import (
    MAX_RECORD_BYTES,
    MAX_RECORDS,
    MAX_TASK_BYTES,
    CallJournal,
    JournalStore,
    decode_record,
    encode_record,
    journaling,
)
from asyncgraph.models._types import MAX_TOKENS, Completion

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

CLIENT = "0123456789abcdef0123456789abcdef"


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


async def test_a_rerun_after_sigkill_replays_the_paid_call(
    redis_url: str, start_worker: StartWorker
) -> None:
    with NumberedServer() as server:
        grad, spent = await kill_after_the_call_then_rerun(
            redis_url, start_worker, server, "journal", "replay"
        )
        assert len(server.requests) == 1  # the rerun made no new HTTP request
    answer = "answer 1 to what is one"
    assert grad == float(len(answer))  # the gradient of a crash-free run: the same answer
    # One call, billed once by the provider and counted once here (the killed worker's
    # usage never reached the client), marked replayed.
    assert spent.requests == 1 and spent.replayed == 1
    assert spent.prompt_tokens == 3 and spent.completion_tokens == len(answer.split())
    assert spent.cost_usd == pytest.approx((3 * 1.0 + len(answer.split()) * 2.0) / 1e6)


async def test_a_rerun_that_asks_something_else_is_not_replayed(
    redis_url: str, start_worker: StartWorker
) -> None:
    with NumberedServer() as server:
        grad, spent = await kill_after_the_call_then_rerun(
            redis_url, start_worker, server, "journal2", "other", new_prompt="what is two"
        )
        assert len(server.requests) == 2  # another request: asked, and paid, again
    assert grad == float(len("answer 2 to what is two"))
    assert spent.requests == 1 and spent.replayed == 0


async def test_tasks_that_ran_once_leave_a_journal_that_expires_with_them(
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, "journal3", *FAST)
    with NumberedServer() as server:
        x = Parameter(1.0, role="x")
        y = F.AskThenHold.apply(x, server.url, "what is three", "once")
        async with open_redis_executor(redis_url, queue="journal3", timeout_s=7) as ex:
            with track_usage() as usage:
                await backward(y, executor=ex)
            client = _client(redis_url)
            try:
                (key,) = client.keys("asyncgraph:{journal3}:calls:*")
                key = key.decode()
                assert key.startswith(f"asyncgraph:{{journal3}}:calls:{ex.client_id}:")
                assert 0 < client.pttl(key) <= 7000  # kept while the client may wait
                assert client.hlen(key) == 2  # the call and the byte count
            finally:
                client.close()
    assert usage.snapshot().requests == 1 and usage.snapshot().replayed == 0


# -- the journal itself, on a real Redis, without workers ---------------------------------


def _journal(
    url: str,
    task: str,
    *,
    rerun: bool,
    ttl_s: float = 30.0,
    signer: Signer | None = None,
    ignored: list[str] | None = None,
) -> CallJournal:
    signer = Signer(SECRET) if signer is None else signer
    store = JournalStore(url, 5.0, signer, None if ignored is None else ignored.append)
    return CallJournal(store, calls_key("q", CLIENT, task), ttl_s=ttl_s, rerun=rerun)


async def test_a_model_call_in_a_task_is_replayed_by_its_rerun_only(redis_url: str) -> None:
    with NumberedServer() as server:
        async with OpenAIChat("gpt-test", server.url, "sk-test") as model:
            with journaling(_journal(redis_url, "t1", rerun=False)):
                first = await model.complete([{"role": "user", "content": "hi"}])
                again = await model.complete([{"role": "user", "content": "hi"}])
            assert len(server.requests) == 2  # a first delivery replays nothing
            with track_usage() as usage, journaling(_journal(redis_url, "t1", rerun=True)):
                # the same two calls, in the same order: both replayed, in order
                assert await model.complete([{"role": "user", "content": "hi"}]) == first
                assert await model.complete([{"role": "user", "content": "hi"}]) == again
                # a third occurrence was never recorded: asked
                third = await model.complete([{"role": "user", "content": "hi"}])
                # another request is never answered from the journal
                other = await model.complete([{"role": "user", "content": "ho"}])
            assert len(server.requests) == 4
            assert third.text == "answer 3 to hi" and other.text == "answer 4 to ho"
            with journaling(_journal(redis_url, "t2", rerun=True)):  # another task's journal
                await model.complete([{"role": "user", "content": "hi"}])
            assert len(server.requests) == 5
    spent = usage.snapshot()
    assert spent.requests == 4 and spent.replayed == 2


async def test_the_journal_of_a_task_is_bounded(redis_url: str) -> None:
    journal = _journal(redis_url, "big", rerun=True)
    answer = Completion("x" * 1000, model="m", prompt_tokens=10, completion_tokens=250)
    for i in range(MAX_RECORDS + 20):
        await journal.record(f"{i:064x}:0", answer)
    client = _client(redis_url)
    try:
        key = journal.key
        assert client.hlen(key) == MAX_RECORDS + 1  # the records and the byte count
        assert int(client.hget(key, "#bytes")) <= MAX_TASK_BYTES
        assert 0 < client.pttl(key) <= 30_000
        used = client.memory_usage(key)
        assert used is not None and used < 2 * MAX_TASK_BYTES
        # An answer longer than a record may be is not kept at all.
        huge = Completion("y" * MAX_RECORD_BYTES, model="m")
        full = _journal(redis_url, "huge", rerun=True)
        await full.record("a:0", huge)
        assert not client.exists(full.key)
        # The first answer of a call stays (a stalled worker may write it a second time).
        await journal.record(f"{0:064x}:0", Completion("other", model="m"))
        assert await journal.replay(f"{0:064x}:0") == answer
    finally:
        client.close()


async def test_a_typical_task_journal_uses_little_memory(redis_url: str) -> None:
    # Ten answers of about 1 KB (some 200 words), what one critique node might make.
    journal = _journal(redis_url, "typical", rerun=True)
    for i in range(10):
        text = " ".join(["word"] * 200)
        await journal.record(f"{i:064x}:0", Completion(text, model="gpt-4o-mini"))
    client = _client(redis_url)
    try:
        used = int(client.memory_usage(journal.key))
    finally:
        client.close()
    logging.getLogger(__name__).info("journal of 10 x 1 KB answers: %d bytes", used)
    assert used < 20_000


@pytest.mark.parametrize("signer", [Signer(None), Signer(SECRET)], ids=["unsigned", "signed"])
async def test_an_unreadable_record_is_a_miss(redis_url: str, signer: Signer) -> None:
    ignored: list[str] = []
    journal = _journal(
        redis_url, f"bad-{signer.enabled}", rerun=True, signer=signer, ignored=ignored
    )
    client = _client(redis_url)
    try:
        for name, payload in [("a:0", b"\x80not json"), ("b:0", b'{"text": 3}')]:
            client.hset(journal.key, name, signer.seal(journal.key, name, payload))
    finally:
        client.close()
    assert await journal.replay("a:0") is None
    assert await journal.replay("b:0") is None
    assert ignored == ["journal", "journal"]
    assert decode_record(encode_record(Completion("ok", model="m"))) == Completion("ok", "m")
    assert decode_record(b"x" * (MAX_RECORD_BYTES + 1)) is None


async def test_redis_down_costs_the_journal_not_the_call(caplog: pytest.LogCaptureFixture) -> None:
    journal = CallJournal(
        JournalStore(f"redis://127.0.0.1:{free_port()}/0", 1.0, Signer(SECRET)),
        calls_key("q", CLIENT, "down"),
        ttl_s=30.0,
        rerun=True,
    )
    with NumberedServer() as server:
        async with OpenAIChat("gpt-test", server.url, "sk-test") as model:
            with caplog.at_level(logging.WARNING, "asyncgraph.models"), journaling(journal):
                answer = await model.complete([{"role": "user", "content": "hi"}])
    assert answer.text == "answer 1 to hi"
    assert "call journal" in caplog.text and "read failed" in caplog.text
    assert "write failed" in caplog.text


def test_the_journal_key_shares_the_queue_hash_slot() -> None:
    assert calls_key("q1", CLIENT, "7").startswith("asyncgraph:{q1}:")
    with pytest.raises(ValueError, match="client id"):
        calls_key("q1", "not-a-client", "7")


# -- issue #33: nothing read back from Redis is trusted unless it is signed ----------------

FORGED = {
    "text": "FORGED",
    "model": "gpt-test",
    "prompt_tokens": 100_000_000_000,  # 1e11 tokens: $15,000 at $150 per million
    "completion_tokens": 1,
}


def _forge_every_record(queue: str) -> Callable[[redis.Redis], None]:
    """What the issue's attacker did with Redis access and no secret: overwrite each
    recorded call of the queue's journals with a forged answer (the field names are the
    call digests, readable by anyone who can read the journal)."""

    def forge(client: redis.Redis) -> None:
        forged = 0
        for key in client.scan_iter(match=f"asyncgraph:{{{queue}}}:calls:*"):
            for field in client.hkeys(key):
                if not field.startswith(b"#"):
                    client.hset(key, field, json.dumps(FORGED))
                    forged += 1
        assert forged == 1, "the first run recorded its one call"

    return forge


def _ignored_records(port: int) -> float:
    status, body = http_get(port, "/metrics")
    for line in body.splitlines() if status == 200 else ():
        if line.startswith('asyncgraph_worker_ignored_records_total{record="journal"}'):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


async def test_a_forged_journal_record_is_ignored_and_the_call_made_again(
    redis_url: str, start_worker: StartWorker
) -> None:
    # The attack on a signed fleet: the killed worker's journal record is replaced
    # by a forged answer before the rerun. The rerun ignores it, reports it, pays again.
    port = free_port()
    with NumberedServer() as server:
        grad, spent = await kill_after_the_call_then_rerun(
            redis_url,
            start_worker,
            server,
            "forged",
            "forged",
            tamper=_forge_every_record("forged"),
            secret=SECRET,
            rerun_flags=("--health-port", str(port)),
        )
        assert len(server.requests) == 2  # asked again: paying twice beats a forgery
    answer = "answer 2 to what is one"
    assert grad == float(len(answer))  # not len("FORGED")
    assert spent.requests == 1 and spent.replayed == 0 and spent.prompt_tokens == 3
    assert spent.cost_usd == pytest.approx((3 * 1.0 + len(answer.split()) * 2.0) / 1e6)
    assert _ignored_records(port) == 1.0  # reported where an operator looks
    # The answer paid for the second time replaced the forgery, sealed.
    client = _client(redis_url)
    try:
        (key,) = [
            k for k in client.scan_iter(match="asyncgraph:{forged}:calls:*") if b":probe:" not in k
        ]
        ((field, stored),) = [(f, v) for f, v in client.hgetall(key).items() if f != b"#bytes"]
    finally:
        client.close()
    record = decode_record(Signer(SECRET).unseal(key.decode(), field.decode(), stored))
    assert record is not None and record.text == answer


async def test_a_forged_or_moved_record_is_ignored_reported_and_replaced(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ignored: list[str] = []
    first = _journal(redis_url, "f1", rerun=False)
    other = _journal(redis_url, "f2", rerun=False)
    client = _client(redis_url)
    with NumberedServer() as server:
        async with OpenAIChat("gpt-test", server.url, "sk-test") as model:
            with journaling(first):
                await model.complete([{"role": "user", "content": "hi"}])
            with journaling(other):
                await model.complete([{"role": "user", "content": "ho"}])
            (call,) = [f for f in client.hkeys(first.key) if f != b"#bytes"]
            (other_call,) = [f for f in client.hkeys(other.key) if f != b"#bytes"]
            genuine = client.hget(first.key, call)
            # Each of these, in place of the genuine record, is ignored and reported:
            forgeries = [
                json.dumps(FORGED).encode(),  # unsigned, as an attacker without the secret
                Signer("another-secret-16b").seal(first.key, call.decode(), b"{}"),
                client.hget(other.key, other_call),  # another task's sealed record
                genuine.replace(b"answer 1", b"answer 9"),  # a sealed record, edited
            ]
            for n, forged in enumerate(forgeries, start=1):
                client.hset(first.key, call, forged)
                rerun = _journal(redis_url, "f1", rerun=True, ignored=ignored)
                with caplog.at_level(logging.WARNING, "asyncgraph.models"), journaling(rerun):
                    answer = await model.complete([{"role": "user", "content": "hi"}])
                assert answer.text == f"answer {n + 2} to hi"  # asked again, never FORGED
                assert ignored == ["journal"] * n
                assert first.key in caplog.text and "failed verification" in caplog.text
                # The new answer replaced the forgery: the next rerun replays it.
                again = _journal(redis_url, "f1", rerun=True, ignored=ignored)
                with journaling(again):
                    assert await model.complete([{"role": "user", "content": "hi"}]) == answer
            assert len(server.requests) == 2 + len(forgeries)
    client.close()


@pytest.mark.parametrize(
    "counts",
    [
        {"prompt_tokens": -5},
        {"completion_tokens": -1},
        {"prompt_tokens": 100_000_000_000},
        {"cache_read_tokens": MAX_TOKENS + 1},
        {"prompt_tokens": 1.5},
        {"prompt_tokens": True},
        {"completion_tokens": "3"},
    ],
)
async def test_token_counts_of_a_record_are_validated(
    redis_url: str, counts: dict[str, Any]
) -> None:
    # Even on an unsigned fleet (nothing authenticated), a record's counts must be
    # integers from 0 to MAX_TOKENS: they reach the bill and the cost cap.
    data = {"text": "t", "model": "m", **counts}
    with pytest.raises(ValueError, match="token count"):
        Completion.from_dict(data)
    ignored: list[str] = []
    journal = _journal(redis_url, "counts", rerun=True, signer=Signer(None), ignored=ignored)
    client = _client(redis_url)
    try:
        client.hset(journal.key, "c:0", json.dumps(data))
    finally:
        client.close()
    assert await journal.replay("c:0") is None and ignored == ["journal"]
    bound = {"text": "t", "model": "m", "prompt_tokens": MAX_TOKENS, "completion_tokens": 0}
    assert Completion.from_dict(bound).prompt_tokens == MAX_TOKENS
