"""Admission (``asyncgraph.distributed.worker._admission.admit``): a pure function, no Redis."""

from __future__ import annotations

from typing import Any

import agdist_functions as F

from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._codec import DEFAULT_LIMITS
from asyncgraph.distributed.wire._schema import TaskMessage, encode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._admission import Admitted, Rules, admit
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._outcomes import Held, Replies, Settled
from asyncgraph.distributed.worker._registry import RegisteredFunction

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
