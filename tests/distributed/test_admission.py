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
from asyncgraph.distributed.worker._admission import Admitted, Rules, admit, batch_clients
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


def entry(function: str = "served", fingerprint: str = "f1", ttl_ms: int = 5000) -> list[Any]:
    message = TaskMessage(QUEUE, CLIENT, "t1", function, fingerprint, "backward", ttl_ms, {})
    packed, signature = encode(message, Signer(SECRET))
    return [keys.F_MESSAGE, packed, keys.F_SIGNATURE, signature]


def run(fields: Any, deliveries: int = 1, **kwargs: Any) -> tuple[Held, Admitted | Settled]:
    held = Held(b"1-0")
    the_rules, replies = kwargs.pop("rules", None) or rules()
    options: dict[str, Any] = {
        "cancelled": set(),
        "deadline_of": lambda entry_id, ttl_ms, now: now + ttl_ms / 1000,
        "now": 100.0,
    }
    options.update(kwargs)
    return held, admit(held, fields, deliveries, the_rules, replies, **options)


def test_a_valid_entry_is_admitted_with_its_key_and_deadline() -> None:
    held, result = run(entry())
    assert isinstance(result, Admitted)
    assert result.message.id == "t1" and result.registered.function is F.Double
    assert held.key == (CLIENT, "t1") and held.deadline == 105.0


def test_cancelled_expired_and_orphaned_tasks_are_settled_without_running() -> None:
    assert run(entry(), cancelled={(CLIENT, "t1")})[1].outcome == "cancelled"  # type: ignore[union-attr]
    assert run(entry(), client_gone=lambda client: client == CLIENT)[1].outcome == "client_gone"  # type: ignore[union-attr]
    expired = run(entry(), deadline_of=lambda entry_id, ttl_ms, now: now)[1]
    assert isinstance(expired, Settled) and expired.outcome == "expired"


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
