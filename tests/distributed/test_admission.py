"""Admission (``asyncgraph.distributed.worker._admission.admit``): a pure function, no Redis."""

from __future__ import annotations

import logging
from typing import Any

import agdist_functions as F
import pytest

from asyncgraph.distributed._liveness import ClientLiveness
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS
from asyncgraph.distributed.wire._schema import ReplyMessage, TaskMessage, decode, encode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._admission import (
    CHUNK,
    EXPIRY_GRACE_MS,
    EXPIRY_SLACK_MS,
    WINDOW_MS,
    Admitted,
    Rules,
    admit,
    batch_clients,
    claim_commands,
    claimed,
    expiry,
    held_by,
    memory_refused,
    replayed,
    task_number,
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
    function: str = "served",
    fingerprint: str = "f1",
    ttl_ms: int = 5000,
    sent_ms: int = 0,
    task_id: str = "7f1",
    expiry_ms: int | None = None,
) -> list[Any]:
    """A signed task entry, sent ``sent_ms`` before the worker reads it."""
    message = TaskMessage(
        QUEUE,
        CLIENT,
        task_id,
        function,
        fingerprint,
        "backward",
        ttl_ms,
        {},
        expiry_ms=REDIS_NOW_MS - sent_ms + ttl_ms if expiry_ms is None else expiry_ms,
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
    assert result.message.id == "7f1" and result.registered.function is F.Double
    # Its signed expiry (5 s after sending) plus the grace, on the worker's clock.
    assert held.key == (CLIENT, "7f1") and held.deadline == 100.0 + 5.0 + EXPIRY_GRACE_MS / 1000


def test_cancelled_and_orphaned_tasks_are_settled_without_running() -> None:
    assert run(entry(), cancelled={(CLIENT, "7f1")})[1].outcome == "cancelled"  # type: ignore[union-attr]
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


def test_a_task_is_claimed_with_its_sealed_entry_id_and_its_mark_asked() -> None:
    held, admitted = run(entry(), entry_id=b"7-0")
    assert isinstance(admitted, Admitted)
    memory = admitted.memory
    window = (REDIS_NOW_MS + 5000) // WINDOW_MS  # of its signed expiry
    assert memory.claims == keys.ran_claims_key(QUEUE, CLIENT, window)
    assert memory.claims.startswith("asyncgraph:{q}:ran:")  # one slot, one ACL pattern
    # Task number 0x7f1 = 2033: bit 2033 % 1024 of chunk 1.
    assert memory.answered == keys.ran_answered_key(QUEUE, CLIENT, window, 1)
    assert (memory.field, memory.bit) == ("7f1", 2033 - CHUNK)
    # Kept until its window's end, the grace and a second: past every copy's expiry.
    assert memory.expire_at_ms == (window + 1) * WINDOW_MS + EXPIRY_GRACE_MS + 1000
    assert memory.expire_at_ms > REDIS_NOW_MS + 5000 + EXPIRY_GRACE_MS
    hsetnx, getbit = claim_commands(held, memory, Signer(SECRET))
    assert hsetnx[:3] == ["HSETNX", memory.claims, "7f1"]
    assert Signer(SECRET).unseal(memory.claims, "7f1", hsetnx[3]) == b"7-0"  # sealed
    assert getbit == ["GETBIT", memory.answered, memory.bit]
    # Each key's expiry once per batch.
    assert expiry([memory, memory], lambda m: m.claims) == [
        ["PEXPIREAT", memory.claims, memory.expire_at_ms]
    ]


def test_the_claim_and_the_mark_decide_whether_a_task_runs() -> None:
    assert claimed(1, 0) == "run"  # claimed now, never answered
    assert claimed(1, 1) == "answered"  # a copy of a task answered already
    assert claimed(0, 1) == "answered"
    assert claimed(0, 0) == "held"  # claimed by an entry: whose? (held_by)
    assert claimed(ReplyError("OOM command not allowed"), 0) == "refused"
    assert claimed(1, ReplyError("WRONGTYPE")) == "refused"


def test_only_the_entry_holding_a_verified_claim_runs_again() -> None:
    signer, held = Signer(SECRET), Held(b"7-0")
    _, admitted = run(entry(), entry_id=b"7-0")
    assert isinstance(admitted, Admitted)
    memory = admitted.memory
    assert held_by(held, memory, signer, signer.seal(memory.claims, "7f1", b"7-0")) is True
    assert held_by(held, memory, signer, signer.seal(memory.claims, "7f1", b"8-0")) is False
    assert held_by(held, memory, signer, None) is False  # released meanwhile
    # Not sealed, or sealed for another task's field: ignored, never trusted.
    assert held_by(held, memory, signer, b"7-0") is None
    assert held_by(held, memory, signer, signer.seal(memory.claims, "7f2", b"7-0")) is None


def test_a_replayed_task_is_dead_lettered_unanswered() -> None:
    the_rules, replies = rules()
    held, admitted = run(entry(), entry_id=b"8-0", rules=(the_rules, replies))
    assert isinstance(admitted, Admitted)
    settled = replayed(held, admitted, "was answered already", replies, release=True)
    assert settled.outcome == "replayed" and settled.client is None
    assert settled.memory == admitted.memory and not settled.answered  # its claim released
    (dead,) = settled.commands
    assert dead[1] == keys.dead_stream(QUEUE) and dead[dead.index(keys.F_REASON) + 1] == "replayed"
    text = dead[dead.index(keys.F_ERROR) + 1]
    assert "was answered already" in text and "entry 8-0 carries it again" in text
    held_elsewhere = replayed(held, admitted, "is run by another entry", replies, release=False)
    assert held_elsewhere.memory is None  # the claim is the other entry's


def test_a_claim_redis_refuses_refuses_the_task_with_what_redis_said() -> None:
    the_rules, replies = rules()
    held, admitted = run(entry(), rules=(the_rules, replies))
    assert isinstance(admitted, Admitted)
    oom = ReplyError("OOM command not allowed when used memory > 'maxmemory'.")
    settled = memory_refused(held, admitted, oom, replies, release=False)
    assert settled.outcome == "memory_refused" and settled.client == CLIENT
    assert settled.memory is None  # its claim was not written
    (xadd,) = settled.commands
    assert xadd[1] == keys.reply_stream(QUEUE, CLIENT)
    reply = decode(xadd[xadd.index(keys.F_MESSAGE) + 1], None, Signer(None), QUEUE)
    assert isinstance(reply, ReplyMessage) and reply.error is not None
    assert reply.error.kind == "redis_refused" and "OOM command not allowed" in reply.error.message
    assert "not run" in reply.error.message


def test_task_ids_that_are_not_task_numbers_are_refused() -> None:
    assert task_number("7f1") == 0x7F1 and task_number("f" * 16) == 2**64 - 1
    for bad in ("t1", "7F1", "", "1" * 17, " 1", "-1"):
        assert task_number(bad) is None, bad
    refused = run(entry(task_id="t1"))[1]
    assert isinstance(refused, Settled) and refused.outcome == "rejected"
    assert refused.client == CLIENT  # told at once, not left to time out
    reply, dead = refused.commands
    assert dead[dead.index(keys.F_REASON) + 1] == "malformed"
    assert b"is not a task number" in reply[reply.index(keys.F_MESSAGE) + 1]


def test_an_absurd_ttl_or_expiry_is_refused_before_anything_is_recorded() -> None:
    # A ttl above the bound does not decode (the schema): refused, answered.
    too_long = run(entry(ttl_ms=keys.MAX_TTL_MS + 1))[1]
    assert isinstance(too_long, Settled) and too_long.outcome == "rejected"
    assert too_long.client == CLIENT
    reply = too_long.commands[0]
    assert b"must be at most 604800000" in reply[reply.index(keys.F_MESSAGE) + 1]
    # The bound itself, sent now, is admitted.
    assert isinstance(run(entry(ttl_ms=keys.MAX_TTL_MS))[1], Admitted)
    # An expiry far past its ttl (a ttl near 2**63 once made Redis refuse the memory's
    # expiry, and the task ran unrecorded): refused.
    for expiry_ms in (2**62, REDIS_NOW_MS + 5000 + EXPIRY_SLACK_MS + 1):
        ahead = run(entry(expiry_ms=expiry_ms))[1]
        assert isinstance(ahead, Settled) and ahead.outcome == "rejected", expiry_ms
        reply = ahead.commands[0]
        assert b"further ahead of the Redis clock" in reply[reply.index(keys.F_MESSAGE) + 1]
    # A client clock a little ahead is fine.
    assert isinstance(run(entry(expiry_ms=REDIS_NOW_MS + 5000 + EXPIRY_SLACK_MS))[1], Admitted)


def test_a_redelivered_task_settled_at_admission_releases_its_claim() -> None:
    """A worker died holding it; its reclaim finds the client gone (stalled): the claim the
    first delivery wrote is released, so the client's resend after the stall runs."""
    _, first = run(entry(), client_gone=lambda client: True)
    assert isinstance(first, Settled) and first.memory is None  # delivery 1: claimed nothing
    _, again = run(entry(), deliveries=2, client_gone=lambda client: True)
    assert isinstance(again, Settled) and again.outcome == "client_gone"
    assert again.memory is not None and not again.answered


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
