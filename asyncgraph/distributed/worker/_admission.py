"""Admission: may this worker run the task in a stream entry, or how is it settled at once?

``admit`` is a pure function of the entry, its delivery count and the worker's
settings: no Redis, no clock of its own (``now`` and ``redis_now_ms`` are given).
``claim_commands`` and ``first_run`` are the replay memory's two halves, also pure.

NOTE [Replays]
A stream entry's id is chosen by whoever adds it, so nothing in it says when the task was
sent: a signed task copied from the stream (``XRANGE``) and added again would pass every
check. Two things stop it. The task carries its expiry inside the signed bytes (``exp``:
the Redis server's ``TIME`` when the client encoded it, as its last heartbeat read it,
plus its timeout), and a task read after it (``EXPIRY_GRACE_MS`` later) is dead-lettered
``expired`` without running. Within its deadline, a task that admission lets through
runs only after its worker wrote the replay memory ``ran_key(queue, client, task id)``
with ``SET NX PX`` (kept until the deadline): the value is the id of the entry that ran
it, so a redelivery of that same entry (a worker died; the reclaimer hands it to
another) still runs, while another entry carrying the same task, added by anyone, is
dead-lettered ``replayed``. One round trip per batch of admitted tasks, for every worker
of the queue at once (memory in one worker would not see a copy read by another).
In an unsigned fleet nothing is authenticated: the expiry and the memory still apply,
but whoever can add an entry can also write any expiry.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._codec import Limits
from asyncgraph.distributed.wire._schema import ErrorInfo, TaskMessage, decode, peek_ids
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._outcomes import Held, Replies, Settled
from asyncgraph.distributed.worker._registry import RegisteredFunction, Registry
from asyncgraph.resp import Oversize, Wide

__all__ = [
    "EXPIRY_GRACE_MS",
    "Admitted",
    "Rules",
    "admit",
    "batch_clients",
    "claim_commands",
    "first_run",
    "replayed",
    "task_deadline",
]

MAX_FIELDS = 16  # a task entry has a handful of fields; more is not ours
# A task outlives its client's deadline by this much: at its deadline the client asks
# Redis where the task is, then cancels it; expired here first, the task would be gone
# from the stream, and the diagnosis could no longer say which worker held it.
EXPIRY_GRACE_MS = 500


@dataclass(frozen=True)
class Admitted:
    """A task to run: the verified message, the function serving it, the entry's fields."""

    message: TaskMessage
    registered: RegisteredFunction
    data: dict[Any, Any]


@dataclass(frozen=True)
class Rules:
    """What admission checks an entry against (one worker's settings)."""

    queue: str
    consumer: str
    signer: Signer
    limits: Limits
    registry: Registry
    max_attempts: int


def admit(
    held: Held,
    fields: Any,
    deliveries: int,
    rules: Rules,
    replies: Replies,
    *,
    cancelled: Container[tuple[str, str]],
    now: float,
    redis_now_ms: float,
    client_gone: Callable[[str], bool] = lambda client: False,
) -> Admitted | Settled:
    """Decode and check one entry read ``deliveries`` times; set ``held.key`` and ``held.deadline``.

    ``now`` is the worker's event-loop clock, ``redis_now_ms`` the Redis server's (``TIME``)
    at the same moment: ``held.deadline`` is the task's signed expiry on the first.
    Settled at once: an entry too big or too wide (read no further), one that does not
    decode or verify, a cancelled task, one past its signed expiry (dead-lettered
    ``expired``, with a short reply unless its client is gone: NOTE [Replays]), one whose
    client is gone (``client_gone`` of the verified client id: its heartbeat key expired,
    NOTE [Client liveness] in ``distributed._liveness``; no reply, nobody would read it),
    one delivered more than ``max_attempts`` times, an unknown function or one whose code
    differs. An ``Admitted`` task runs only once its replay memory is claimed
    (``claim_commands``).
    """
    data: dict[Any, Any] = {}
    if isinstance(fields, list):
        data = dict(zip(fields[::2], fields[1::2], strict=False))
    too_big = _too_big(held, fields, data, rules, replies)
    if too_big is not None:
        return too_big
    packed, signature = data.get(keys.F_MESSAGE), data.get(keys.F_SIGNATURE)
    try:
        message = decode(packed, signature, rules.signer, rules.queue, rules.limits)
        if not isinstance(message, TaskMessage):
            raise WireError(f"a {type(message).__name__} in the task stream")
    except WireError as exc:
        return _refuse(held, data, packed, signature, exc, rules, replies)
    held.key = (message.client, message.id)
    if held.key in cancelled:
        return replies.settled(held, "cancelled")
    gone = client_gone(message.client)
    held.deadline = task_deadline(message.expiry_ms, redis_now_ms, now)
    if held.deadline <= now:
        # Dead-lettered whether its client lives or not: a replay comes after the client
        # that sent it has often closed (NOTE [Replays]).
        late_s = (redis_now_ms - message.expiry_ms) / 1000
        text = (
            f"task {message.id} of {message.function!r} was read {late_s:.3g} s after its "
            f"signed expiry (its client waits {message.ttl_ms / 1000:g} s): not run; moved to "
            f"the dead-letter stream {replies.dead_stream!r} (a replayed copy of an old "
            f"task ends here too)"
        )
        dead = replies.dead_letter(held, keys.REASON_EXPIRED, text, data)
        if gone:
            return replies.settled(held, "expired", [dead])
        info = ErrorInfo("dead_letter", "TimeoutError", text)
        return replies.error(held, message.client, message.id, info, "expired", dead)
    if gone:
        return replies.settled(held, "client_gone")
    if deliveries > rules.max_attempts:
        text = (
            f"task {message.id} of {message.function!r} was delivered {deliveries} times "
            f"without completing (each worker holding it died or lost its lease); "
            f"max_attempts is {rules.max_attempts}: moved to the dead-letter stream "
            f"{replies.dead_stream!r}"
        )
        dead = replies.dead_letter(held, keys.REASON_MAX_ATTEMPTS, text, data)
        info = ErrorInfo("dead_letter", "DeadLetter", text)
        return replies.error(held, message.client, message.id, info, "dead_letter", dead)
    registered = rules.registry.get(message.function)
    if registered is None:
        served = ", ".join(sorted(rules.registry)) or "nothing"
        info = ErrorInfo(
            "unknown_function",
            "LookupError",
            f"function {message.function!r} is not served by the workers of queue "
            f"{rules.queue!r} (worker {rules.consumer} serves: {served}); start the "
            f"workers with --import <the module defining it>, or set remote_name",
        )
        return replies.error(held, message.client, message.id, info, "unknown_function")
    if registered.fingerprint != message.fingerprint:
        info = ErrorInfo(
            "fingerprint",
            "LookupError",
            f"function {message.function!r} on queue {rules.queue!r} has fingerprint "
            f"{registered.fingerprint} on worker {rules.consumer} but {message.fingerprint} on "
            f"the client: they run different code; deploy the same version to both",
        )
        return replies.error(held, message.client, message.id, info, "fingerprint")
    return Admitted(message, registered, data)


def _too_big(
    held: Held, fields: Any, data: dict[Any, Any], rules: Rules, replies: Replies
) -> Settled | None:
    """Settle an entry with a field skipped unread (``Oversize``) or too many fields."""
    if type(fields) is list and len(fields) <= 2 * MAX_FIELDS:
        if all(type(v) is bytes for v in fields):
            return None  # the usual entry: a handful of fields, every name and value read
    wide = isinstance(fields, Wide)
    oversize = [v for v in (*data, *data.values()) if isinstance(v, Oversize)]
    if not oversize and not wide and len(data) <= MAX_FIELDS:
        return None
    if oversize:
        text = (
            f"entry has a field of {oversize[0].size} bytes, above this worker's limit of "
            f"{rules.limits.max_message_bytes} (max_message_bytes); it was not read"
        )
    else:
        count = fields.count // 2 if wide else len(data)
        text = f"entry has {count} fields (a task has at most {MAX_FIELDS}); it was not read"
    reason = keys.REASON_OVERSIZE if oversize else keys.REASON_MALFORMED
    dead = replies.dead_letter(held, reason, text, data)
    # Nothing of it can be verified. Without a secret (anyone may write any task anyway)
    # the entry's hints say whom to tell.
    ids = None if rules.signer.enabled else hinted_ids(data)
    if ids is None:
        return replies.settled(held, "rejected", [dead])
    return replies.refused(
        held,
        *ids,
        f"{text}; send less data or raise --max-message-bytes on the workers",
        dead,
    )


def _refuse(
    held: Held,
    data: dict[Any, Any],
    packed: Any,
    signature: Any,
    exc: WireError,
    rules: Rules,
    replies: Replies,
) -> Settled:
    """Dead-letter an entry that does not decode; answer its client when it may be trusted.

    A message whose signature does not check out is never answered: a reply would
    be signed by this worker on behalf of whoever wrote the entry.
    """
    forged = (
        isinstance(packed, bytes)
        and rules.signer.verify(packed, signature if isinstance(signature, bytes) else None)
        is not None
    )
    reason = keys.REASON_FORGED if forged else keys.REASON_MALFORMED
    dead = replies.dead_letter(held, reason, str(exc), data)
    ids = None if forged else peek_ids(packed, rules.queue, "task")
    if ids is None:
        return replies.settled(held, "rejected", [dead])
    return replies.refused(held, *ids, str(exc), dead)


def hinted_ids(data: dict[Any, Any]) -> tuple[str, str] | None:
    """(client, task id) from an entry's unsigned hints, when both are well formed."""
    client, task_id = data.get(keys.F_CLIENT_HINT), data.get(keys.F_TASK_HINT)
    if not (isinstance(client, bytes) and isinstance(task_id, bytes) and 0 < len(task_id) <= 64):
        return None
    client_id = client.decode(errors="replace")
    return (client_id, task_id.decode(errors="replace")) if keys.is_client_id(client_id) else None


def batch_clients(entries: Iterable[Any]) -> list[str]:
    """The clients to ask about for a batch of entries (``(entry_id, fields, ...)`` each), once each.

    An entry names its client in its unsigned hints, and says the client keeps a
    heartbeat key (``F_BEATS_HINT``); an entry without both (a client of an older
    version, a hand-written entry) is not asked about, and its client is taken as
    alive. Only which keys to ask for: admission decides on the verified client id of
    the message, so a false hint costs a lookup, never another client's task.
    """
    clients: dict[str, None] = {}
    for entry in entries:
        fields = entry[1] if entry is not None else None
        if type(fields) is not list:
            continue
        hint, beats = None, False
        for i in range(0, min(len(fields), 2 * MAX_FIELDS) - 1, 2):
            if fields[i] == keys.F_CLIENT_HINT:
                hint = fields[i + 1]
            elif fields[i] == keys.F_BEATS_HINT:
                beats = True
        if beats and type(hint) is bytes and len(hint) == 32:
            client = hint.decode(errors="replace")
            if keys.is_client_id(client):
                clients[client] = None
    return list(clients)


def task_deadline(expiry_ms: int, redis_now_ms: float, now: float) -> float:
    """A task's deadline on the clock of ``now``: its signed expiry (Redis ms, read at
    ``redis_now_ms``) plus ``EXPIRY_GRACE_MS``."""
    return now + (expiry_ms + EXPIRY_GRACE_MS - redis_now_ms) / 1000


def claim_commands(queue: str, held: Held, message: TaskMessage, now: float) -> list[list[Any]]:
    """The replay memory of an admitted task: ``SET NX PX`` its entry id, then ``GET`` who holds
    it, kept until the task's deadline (``held.deadline``, on the clock of ``now``).

    Two commands, not ``SET ... NX GET`` (Redis 7 only), in the batch's one round trip.
    """
    key = keys.ran_key(queue, message.client, message.id)
    ttl_ms = max(1, int((held.deadline - now) * 1000) + 1)
    return [["SET", key, held.entry_id, "NX", "PX", ttl_ms], ["GET", key]]


def first_run(held: Held, set_reply: Any, get_reply: Any) -> bool:
    """Whether ``held`` may run, from the replies to its ``claim_commands``.

    Yes when this entry wrote the memory, or holds it from an earlier delivery (a
    reclaimed entry); no when another entry holds it (a replay). Yes also when Redis
    refused the write (an error reply, e.g. out of memory): a write refused is not a
    replay, and at-least-once wins over at-most-once there.
    """
    if set_reply is None and isinstance(get_reply, bytes):
        return get_reply == held.entry_id
    return True


def replayed(held: Held, admitted: Admitted, ran_by: Any, replies: Replies) -> Settled:
    """Settle a task that entry ``ran_by`` already ran (NOTE [Replays]): dead-lettered, unanswered.

    No reply: the first run answers, and an error here would fail the task its client
    may still be waiting for.
    """
    message = admitted.message
    first = ran_by.decode(errors="replace") if isinstance(ran_by, bytes) else "?"
    text = (
        f"task {message.id} of {message.function!r} already ran from entry {first}; entry "
        f"{held.entry_id.decode(errors='replace')} carries it again (a replay, or a resend "
        f"of a task whose reply was lost): not run"
    )
    dead = replies.dead_letter(held, keys.REASON_REPLAYED, text, admitted.data)
    return replies.settled(held, "replayed", [dead])
