"""Admission (``asyncgraph.distributed.worker._admission.admit``): a pure function, no Redis."""

from __future__ import annotations

import logging
from typing import Any

import agdist_functions as F
import pytest

from asyncgraph.distributed._liveness import ClientLiveness
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._codec import DEFAULT_LIMITS
from asyncgraph.distributed.wire._schema import TaskMessage, encode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._admission import (
    EXPIRY_GRACE_MS,
    Admitted,
    Rules,
    admit,
    batch_clients,
    claim_commands,
    first_run,
    replayed,
)
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._outcomes import (
    MAX_ORIGINAL,
    UNTRUSTED_ORIGINAL,
    Held,
    Replies,
    Settled,
    dead_maxlen,
)
from asyncgraph.distributed.worker._registry import RegisteredFunction
from asyncgraph.resp import ReplyError

QUEUE, SECRET = "q", "0123456789abcdef0123"
CLIENT = "c" * 32  # a client id: 32 hex digits


def rules(max_attempts: int = 3, signer: Signer | None = None) -> tuple[Rules, Replies]:
    signer = signer or Signer(SECRET)
    registry = {"served": RegisteredFunction("served", F.Double, "f1")}
    rules = Rules(QUEUE, "w1", signer, DEFAULT_LIMITS, registry, max_attempts)
    return rules, Replies(QUEUE, "w1", signer, DEFAULT_LIMITS, Metrics())


REDIS_NOW_MS = 1_795_575_131_132  # the Redis server's clock as the worker reads the entry


def entry(
    function: str = "served", fingerprint: str = "f1", ttl_ms: int = 5000, sent_ms: int = 0
) -> list[Any]:
    """A signed task entry, sent ``sent_ms`` before the worker reads it."""
    message = TaskMessage(
        QUEUE,
        CLIENT,
        "t1",
        function,
        fingerprint,
        "backward",
        ttl_ms,
        {},
        expiry_ms=REDIS_NOW_MS - sent_ms + ttl_ms,
    )
    packed, signature = encode(message, Signer(SECRET))
    return [keys.F_MESSAGE, packed, keys.F_SIGNATURE, signature]


def run(fields: Any, deliveries: int = 1, **kwargs: Any) -> tuple[Held, Admitted | Settled]:
    held = Held(kwargs.pop("entry_id", b"1-0"))
    the_rules, replies = kwargs.pop("rules", None) or rules()
    options: dict[str, Any] = {"cancelled": set(), "now": 100.0, "redis_now_ms": REDIS_NOW_MS}
    options.update(kwargs)
    return held, admit(held, fields, deliveries, the_rules, replies, **options)


def test_a_valid_entry_is_admitted_with_its_key_and_deadline() -> None:
    held, result = run(entry())
    assert isinstance(result, Admitted)
    assert result.message.id == "t1" and result.registered.function is F.Double
    # Its signed expiry (5 s after sending) plus the grace, on the worker's clock.
    assert held.key == (CLIENT, "t1") and held.deadline == 100.0 + 5.0 + EXPIRY_GRACE_MS / 1000


def test_cancelled_and_orphaned_tasks_are_settled_without_running() -> None:
    assert run(entry(), cancelled={(CLIENT, "t1")})[1].outcome == "cancelled"  # type: ignore[union-attr]
    assert run(entry(), client_gone=lambda client: client == CLIENT)[1].outcome == "client_gone"  # type: ignore[union-attr]


def test_a_task_past_its_signed_expiry_is_dead_lettered_and_its_live_client_told() -> None:
    # Sent 6 s ago with a 5 s timeout: past the expiry and its grace. The entry id says
    # nothing (whoever adds an entry picks it): a fresh-looking id changes nothing.
    held, expired = run(entry(sent_ms=5000 + EXPIRY_GRACE_MS), entry_id=b"99999999999999-0")
    assert isinstance(expired, Settled) and expired.outcome == "expired"
    assert held.deadline <= 100.0
    reply, dead = expired.commands
    assert dead[1] == keys.dead_stream(QUEUE) and dead[dead.index(keys.F_REASON) + 1] == "expired"
    assert reply[1] == keys.reply_stream(QUEUE, CLIENT) and expired.client == CLIENT
    # Its client is gone: dead-lettered all the same (a replay often comes after the
    # client closed), not answered.
    gone = run(entry(sent_ms=6000), client_gone=lambda client: True)[1]
    assert isinstance(gone, Settled) and gone.outcome == "expired" and gone.client is None
    assert [c[1] for c in gone.commands] == [keys.dead_stream(QUEUE)]
    # Within the grace it still runs: the client may still take its reply.
    assert isinstance(run(entry(sent_ms=5000 + EXPIRY_GRACE_MS - 1))[1], Admitted)
    # An old entry id does not expire a task whose signed expiry is ahead.
    assert isinstance(run(entry(), entry_id=b"1-1")[1], Admitted)


def test_the_replay_memory_is_claimed_until_the_deadline_with_the_entry_id() -> None:
    held, admitted = run(entry(), entry_id=b"7-0")
    assert isinstance(admitted, Admitted)
    set_, get = claim_commands(QUEUE, held, admitted.message, now=100.0)
    key = keys.ran_key(QUEUE, CLIENT, "t1")
    assert key.startswith("asyncgraph:{q}:")  # the queue's hash tag: one slot in a Cluster
    assert set_ == ["SET", key, b"7-0", "NX", "PX", 5000 + EXPIRY_GRACE_MS + 1]
    assert get == ["GET", key]


def test_only_the_entry_that_claimed_a_task_runs_it() -> None:
    held = Held(b"7-0")
    assert first_run(held, b"OK", b"7-0")  # claimed now
    assert first_run(held, None, b"7-0")  # claimed by this entry before: a redelivery
    assert not first_run(held, None, b"8-0")  # another entry ran it: a replay
    assert first_run(held, ReplyError("OOM command not allowed"), None)  # not recorded: runs
    assert first_run(held, None, None)  # expired between the two commands: nothing ran it


def test_a_replayed_task_is_dead_lettered_unanswered() -> None:
    the_rules, replies = rules()
    held, admitted = run(entry(), entry_id=b"8-0", rules=(the_rules, replies))
    assert isinstance(admitted, Admitted)
    settled = replayed(held, admitted, b"7-0", replies)
    assert settled.outcome == "replayed" and settled.client is None
    (dead,) = settled.commands
    assert dead[1] == keys.dead_stream(QUEUE) and dead[dead.index(keys.F_REASON) + 1] == "replayed"
    text = dead[dead.index(keys.F_ERROR) + 1]
    assert "already ran from entry 7-0" in text and "entry 8-0 carries it again" in text


def test_an_entry_delivered_too_often_is_dead_lettered_and_answered() -> None:
    _, result = run(entry(), deliveries=4)
    assert isinstance(result, Settled) and result.outcome == "dead_letter"
    commands = [c[0:2] for c in result.commands]
    assert ["XADD", keys.dead_stream(QUEUE)] in commands  # the dead letter, and a reply
    assert any(c[0] == "XADD" and c[1] != keys.dead_stream(QUEUE) for c in result.commands)


def test_unknown_functions_and_other_code_are_refused_with_a_reply() -> None:
    unknown = run(entry(function="other"))[1]
    assert isinstance(unknown, Settled) and unknown.outcome == "unknown_function"
    changed = run(entry(fingerprint="f2"))[1]
    assert isinstance(changed, Settled) and changed.outcome == "fingerprint"


def test_an_entry_that_does_not_verify_is_never_admitted() -> None:
    other = rules(signer=Signer("another-secret-of-16b"))
    held, result = run(entry(), rules=other)
    assert isinstance(result, Settled)
    assert held.key is None  # nothing of an unverified message is trusted


# -- a dead client's tasks (NOTE [Client liveness]) --------------------------------------


def test_a_batch_names_each_client_that_beats_once_and_ignores_malformed_hints() -> None:
    other = "d" * 32
    beats = [keys.F_BEATS_HINT, b"1"]
    entries = [
        (b"1-0", [keys.F_MESSAGE, b"m", keys.F_CLIENT_HINT, CLIENT.encode(), *beats]),
        (b"2-0", [*beats, keys.F_CLIENT_HINT, other.encode(), keys.F_MESSAGE, b"m"]),
        (b"3-0", [keys.F_MESSAGE, b"m", keys.F_CLIENT_HINT, CLIENT.encode(), *beats]),
        (b"4-0", [keys.F_CLIENT_HINT, b"not-a-client-id", *beats]),
        (b"5-0", [keys.F_CLIENT_HINT, b"C" * 32, *beats]),  # not lowercase hex
        (b"6-0", [keys.F_MESSAGE, b"no hint", *beats]),
        (b"7-0", None),  # deleted while pending (Redis 6.2)
        (b"8-0", [keys.F_CLIENT_HINT, other.encode(), *beats], 2),  # a reclaimed entry
        (b"9-0", [keys.F_CLIENT_HINT, ("e" * 32).encode()]),  # an older client: no key to ask
    ]
    assert batch_clients(entries) == [CLIENT, other]


def test_client_liveness_asks_each_client_once_per_recheck_period() -> None:
    liveness = ClientLiveness(recheck_s=0.25)
    alive, dead = CLIENT, "d" * 32
    assert not liveness.gone(alive)  # never asked: alive
    assert liveness.to_ask([alive, dead, alive], now=10.0) == [alive, dead]
    liveness.learn([alive, dead], [1, 0], now=10.0)
    assert not liveness.gone(alive) and liveness.gone(dead)
    # Alive is believed for recheck_s (no round trip); gone is asked again each batch (its
    # heartbeat may come back, and the tasks it sends again must run).
    assert liveness.to_ask([alive, dead], now=10.2) == [dead]
    assert liveness.to_ask([alive, dead], now=10.25) == [alive, dead]
    # An error is no answer: what was known stays; a client that came back is alive again.
    liveness.learn([alive, dead], [ReplyError("ERR whatever"), 1], now=10.3)
    assert not liveness.gone(alive) and not liveness.gone(dead)


def test_client_liveness_forgets_the_oldest_answers_first() -> None:
    liveness = ClientLiveness()
    clients = [f"{i:032x}" for i in range(ClientLiveness.MAX_KNOWN + 10)]
    liveness.learn(clients, [0] * len(clients), now=1.0)
    assert not liveness.gone(clients[0])  # forgotten: taken as alive until asked again
    assert liveness.gone(clients[-1])


def test_a_gone_clients_task_is_skipped_unanswered_whatever_its_hint_says() -> None:
    _, result = run(entry(), client_gone=lambda client: client == CLIENT)
    assert isinstance(result, Settled) and result.outcome == "client_gone"
    assert result.commands == [] and result.client is None  # nobody would read a reply
    # The decision reads the verified client of the message, never the hint.
    fields = [*entry(), keys.F_CLIENT_HINT, b"d" * 32]
    assert isinstance(run(fields, client_gone=lambda c: c == "d" * 32)[1], Admitted)


# -- dead letters: small for garbage, bounded by bytes ----------------------------------


def test_a_forged_entry_keeps_a_few_hundred_bytes_and_a_failed_task_its_message() -> None:
    garbage = bytes(range(256)) * 256  # 64 KiB
    _, forged = run([keys.F_MESSAGE, garbage, keys.F_SIGNATURE, b"00"])
    assert isinstance(forged, Settled)
    (xadd,) = forged.commands
    fields = dict(zip(xadd[5::2], xadd[6::2], strict=True))
    assert fields[keys.F_REASON] == keys.REASON_FORGED
    assert fields[keys.F_ORIGINAL] == garbage[:UNTRUSTED_ORIGINAL]
    assert xadd[2:4] == ["MAXLEN", keys.DEAD_MAXLEN]  # exact: small entries, 10,000 of them
    # A verified task delivered too often keeps its message whole (it can be re-run).
    _, poison = run(entry(), deliveries=4)
    assert isinstance(poison, Settled)
    (dead,) = [c for c in poison.commands if c[1] == keys.dead_stream(QUEUE)]
    fields = dict(zip(dead[5::2], dead[6::2], strict=True))
    assert fields[keys.F_ORIGINAL] == entry()[1]


def test_the_dead_letter_stream_is_bounded_by_bytes_as_well_as_entries() -> None:
    assert dead_maxlen(500) == keys.DEAD_MAXLEN
    assert dead_maxlen(100_000) == keys.DEAD_MAX_BYTES // 100_000
    assert dead_maxlen(10**12) == 1  # never 0: MAXLEN 0 would drop the letter itself
    _, replies = rules()
    big = [keys.F_MESSAGE, b"x" * MAX_ORIGINAL]
    xadd = replies.dead_letter(Held(b"1-0"), keys.REASON_ERROR, "e" * 40_000, {b"m": big[1]})
    assert xadd[2] == "MAXLEN" and xadd[3] * (MAX_ORIGINAL + 32_768) <= keys.DEAD_MAX_BYTES


def test_a_flood_of_dead_letters_logs_one_line_per_reason_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, replies = rules()
    caplog.set_level(logging.WARNING, logger="asyncgraph.distributed.worker")
    for i in range(1000):
        replies.dead_letter(Held(f"{i}-0".encode()), keys.REASON_FORGED, "bad HMAC", {})
    replies.dead_letter(Held(b"x-0"), keys.REASON_MALFORMED, "not msgpack", {})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the first of each reason; the metric counts all 1,001
    assert replies.metrics.get("asyncgraph_worker_dead_letters_total", reason="forged") == 1000
    replies._dead_logged[keys.REASON_FORGED] = (0.0, 999)  # as if a second had passed
    replies.dead_letter(Held(b"y-0"), keys.REASON_FORGED, "bad HMAC", {})
    assert "999 more forged dead letter(s) not logged" in caplog.records[-1].getMessage()
