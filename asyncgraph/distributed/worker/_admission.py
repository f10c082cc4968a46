"""Admission: may this worker run the task in a stream entry, or how is it settled at once?

``admit`` is a pure function of the entry, its delivery count and the worker's
settings: no Redis, no clock of its own (``now`` and ``redis_now_ms`` are given).
``claim_commands`` and ``claimed`` are the replay memory's two halves, also pure.

NOTE [Replays]
A stream entry's id is chosen by whoever adds it, so nothing in it says when the task was
sent: a signed task copied from the stream (``XRANGE``) and added again would pass every
check. Two things stop it. The task carries its expiry inside the signed bytes (``exp``:
the Redis server's ``TIME`` when the client encoded it, as its last heartbeat read it,
plus its timeout, at most ``keys.MAX_TTL_MS``; an expiry further ahead than that is
refused), and a task read after it (``EXPIRY_GRACE_MS`` later) is dead-lettered
``expired`` without running. Within its deadline, the replay memory in Redis, shared by
every worker of the queue (memory in one worker would not see a copy read by another),
keeps two things of each task, under keys of its client and of the window of
``WINDOW_MS`` its expiry falls in, kept until that window's end plus the grace:

- while it runs, its *claim*: ``HSETNX`` of the task id in the hash ``ran_claims_key``,
  the value the id of the entry that runs it, sealed (``Signer.seal``: NOTE [Sealed
  records]), so a redelivery of that same entry (a worker died; the reclaimer hands it
  to another) runs again, while another entry carrying the task does not. Released
  (``HDEL``) with the transaction that settles it, so claims cost Redis only the tasks
  in flight;
- once it is answered, its *mark*: one bit (its task number, the client's counter, in a
  bitmap ``ran_answered_key`` of ``CHUNK`` numbers), set in that same transaction.

An admitted task runs only after its worker claimed it (``claim_commands``: one round trip
per batch) and found no mark (``claimed``); a claim held by another entry is read
(``HGET``, a second round trip, only then) and unsealed (``held_by``). Another entry
carrying a task that is marked, or claimed by another entry, is dead-lettered
``replayed`` without running and without an answer: the answer is the first run's,
which its client reads from its reply stream, kept until the client's deadline
(``keys.reply_ttl_s``); so a client that sends a task again after its heartbeat lapsed
finds the reply of the first run there and does not resend a task that was answered. A
claim Redis refuses (an error reply: out of memory) refuses the task (``memory_refused``,
answered): it does not run unrecorded; a claim whose round trip is lost is handed back
(the entry stays pending, and its reclaim finds its own claim, or none).
In an unsigned fleet nothing is authenticated: the expiry and the memory still apply,
but whoever can add an entry can also write any expiry.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import Limits
from asyncgraph.distributed.wire._schema import ErrorInfo, TaskMessage, decode, peek_ids
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._outcomes import Held, Memory, Replies, Settled
from asyncgraph.distributed.worker._registry import RegisteredFunction, Registry
from asyncgraph.resp import Oversize, ReplyError, Wide

__all__ = [
    "CHUNK",
    "EXPIRY_GRACE_MS",
    "EXPIRY_SLACK_MS",
    "MAX_FIELDS",
    "WINDOW_MS",
    "Admitted",
    "Rules",
    "admit",
    "batch_clients",
    "claim_commands",
    "claimed",
    "expiry",
    "held_by",
    "memory_refused",
    "replayed",
    "task_deadline",
    "task_memory",
    "task_number",
    "unverified_claim",
]

MAX_FIELDS = 16  # a task entry has a handful of fields; more is not ours
# A task outlives its client's deadline by this much: at its deadline the client asks
# Redis where the task is, then cancels it; expired here first, the task would be gone
# from the stream, and the diagnosis could no longer say which worker held it.
EXPIRY_GRACE_MS = 500
# A signed expiry may be this much further ahead of the Redis clock than the task's ttl:
# the client counts it on its estimate of that clock (read with its last heartbeat).
EXPIRY_SLACK_MS = 60_000
# The replay memory (NOTE [Replays]): tasks whose expiries fall in one window of WINDOW_MS
# share its keys, each kept until its window's end; a bitmap holds CHUNK task numbers
# (at most CHUNK / 8 bytes).
WINDOW_MS = 10_000
CHUNK = 1024
_TASK_NUMBER_DIGITS = 16  # a task id is the client's counter in hex: at most this many digits


@dataclass(frozen=True)
class Admitted:
    """A task to run: the verified message, the function serving it, the entry's fields,
    and its place in the replay memory."""

    message: TaskMessage
    registered: RegisteredFunction
    data: dict[Any, Any]
    memory: Memory


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
    decode or verify (a ``ttl`` above ``keys.MAX_TTL_MS`` among them), one whose task id
    is not a task number or whose signed expiry is further ahead than its ttl allows
    (``EXPIRY_SLACK_MS``), a cancelled task, one past its signed expiry (dead-lettered
    ``expired``, with a short reply unless its client is gone: NOTE [Replays]), one whose
    client is gone (``client_gone`` of the verified client id: its heartbeat key expired,
    NOTE [Client liveness] in ``distributed._liveness``; no reply, nobody would read it),
    one delivered more than ``max_attempts`` times, an unknown function or one whose code
    differs. An ``Admitted`` task runs only once it is claimed in the replay memory
    (``claim_commands``). A task settled here on a redelivery releases the claim an
    earlier delivery may have left.
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
    memory = task_memory(rules.queue, message)
    ahead_ms = message.expiry_ms - redis_now_ms - message.ttl_ms
    if memory is None or ahead_ms > EXPIRY_SLACK_MS:
        if memory is None:
            text = (
                f"task id {message.id!r} is not a task number (the client's counter in "
                f"lowercase hex, at most {_TASK_NUMBER_DIGITS} digits)"
            )
        else:
            text = (
                f"its signed expiry is {ahead_ms / 1000:.3g} s further ahead of the Redis "
                f"clock than its ttl of {message.ttl_ms / 1000:g} s (more than "
                f"{EXPIRY_SLACK_MS / 1000:g} s: a client clock far off, or not our client)"
            )
        dead = replies.dead_letter(held, keys.REASON_MALFORMED, text, data)
        refused = replies.refused(held, message.client, message.id, text, dead)
        refused.reply_ttl_s = keys.reply_ttl_s(message.ttl_ms)
        return refused
    decided = _decide(
        held, message, data, deliveries, rules, replies, cancelled, now, redis_now_ms, client_gone
    )
    if isinstance(decided, Settled):
        if decided.client is not None:
            decided.reply_ttl_s = keys.reply_ttl_s(message.ttl_ms)
        if deliveries > 1:
            decided.memory = memory  # an earlier delivery may hold the claim: release it
        return decided
    return Admitted(message, decided, data, memory)


def _decide(
    held: Held,
    message: TaskMessage,
    data: dict[Any, Any],
    deliveries: int,
    rules: Rules,
    replies: Replies,
    cancelled: Container[tuple[str, str]],
    now: float,
    redis_now_ms: float,
    client_gone: Callable[[str], bool],
) -> RegisteredFunction | Settled:
    """The function that serves a verified task, or how it is settled at once (``admit``)."""
    assert held.key is not None
    if held.key in cancelled:
        return replies.stopped(held, "cancelled")
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
    return registered


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
    ids = None if rules.signer.enabled else _hinted_ids(data)
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


def _hinted_ids(data: dict[Any, Any]) -> tuple[str, str] | None:
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


def task_number(task_id: str) -> int | None:
    """The number of a task id (the client's counter in lowercase hex), or None."""
    if not 0 < len(task_id) <= _TASK_NUMBER_DIGITS or task_id.strip("0123456789abcdef"):
        return None
    return int(task_id, 16)


def task_memory(queue: str, message: TaskMessage) -> Memory | None:
    """Where the replay memory keeps ``message``'s task (NOTE [Replays]); None when its id is
    not a task number.

    Its keys are those of its client and of the window of ``WINDOW_MS`` its signed expiry
    falls in; they expire at the window's end plus ``EXPIRY_GRACE_MS`` (and a second for
    the clocks of the workers, which each read Redis's), when every copy of its tasks is
    refused as ``expired`` anyway.
    """
    number = task_number(message.id)
    if number is None:
        return None
    window = message.expiry_ms // WINDOW_MS
    chunk, bit = divmod(number, CHUNK)
    return Memory(
        keys.ran_claims_key(queue, message.client, window),
        message.id,
        keys.ran_answered_key(queue, message.client, window, chunk),
        bit,
        (window + 1) * WINDOW_MS + EXPIRY_GRACE_MS + 1000,
    )


def claim_commands(held: Held, memory: Memory, signer: Signer) -> list[list[Any]]:
    """Claim a task in the replay memory for ``held``'s entry, and ask whether it was answered:
    ``HSETNX`` of its sealed entry id, ``GETBIT`` of its mark (NOTE [Replays]).

    The claims key's ``PEXPIREAT`` is the caller's, once per key of a batch (``expiry``).
    """
    sealed = signer.seal(memory.claims, memory.field, held.entry_id)
    return [
        ["HSETNX", memory.claims, memory.field, sealed],
        ["GETBIT", memory.answered, memory.bit],
    ]


def expiry(memories: Iterable[Memory], key: Callable[[Memory], str]) -> list[list[Any]]:
    """``PEXPIREAT`` of the keys ``key`` picks from ``memories``, once each."""
    at = {key(m): m.expire_at_ms for m in memories}
    return [["PEXPIREAT", k, expire_at] for k, expire_at in at.items()]


def claimed(set_reply: Any, bit_reply: Any) -> str:
    """What the replies to a task's ``claim_commands`` say.

    ``"run"``: this entry claimed it and it was not answered; ``"answered"``: it was (a
    replay; a claim this entry wrote, ``set_reply == 1``, is to be released);
    ``"held"``: another claim holds it (read it: ``held_by``); ``"refused"``: Redis
    refused a command (an error reply, e.g. out of memory: ``memory_refused``).
    """
    if isinstance(set_reply, ReplyError) or isinstance(bit_reply, ReplyError):
        return "refused"
    if bit_reply == 1:
        return "answered"
    return "held" if set_reply == 0 else "run"


def held_by(held: Held, memory: Memory, signer: Signer, stored: Any) -> bool | None:
    """Whether the claim read back (``HGET``) is ``held``'s own (a redelivery of the entry
    that claimed it: it runs); None when it does not verify (``Signer.unseal``: ignored,
    never trusted, and reported by the caller); False for another entry's, or none (the
    task was settled meanwhile)."""
    if stored is None:
        return False
    entry_id = signer.unseal(memory.claims, memory.field, stored)
    if entry_id is None:
        return None
    return entry_id == held.entry_id


def replayed(
    held: Held, admitted: Admitted, why: str, replies: Replies, *, release: bool
) -> Settled:
    """Settle a task that another entry runs or ran (NOTE [Replays]): dead-lettered, unanswered.

    No reply: the first run answers (its reply waits in the client's reply stream until
    read), and an error here would fail the task its client may still be waiting for.
    ``release``: this entry's claim is released with it (it claimed a task already answered).
    """
    message = admitted.message
    text = (
        f"task {message.id} of {message.function!r} {why}; entry "
        f"{held.entry_id.decode(errors='replace')} carries it again (a replay, or a resend "
        f"of a task whose reply is on its way): not run"
    )
    dead = replies.dead_letter(held, keys.REASON_REPLAYED, text, admitted.data)
    settled = replies.settled(held, "replayed", [dead])
    if release:
        settled.memory = admitted.memory
    return settled


def unverified_claim(held: Held, admitted: Admitted, replies: Replies) -> Settled:
    """Settle a task whose claim in the replay memory does not verify (forged, or written
    with another secret): not run on its word, dead-lettered ``replayed``, and its client
    answered with an error naming the claim, so that it does not wait its whole timeout."""
    message = admitted.message
    text = (
        f"task {message.id} of {message.function!r} has a claim in the replay memory that "
        f"does not verify (forged, or written with another secret): not run; moved to the "
        f"dead-letter stream {replies.dead_stream!r}. Check that every worker and client "
        f"shares one secret, and who else can write the replay memory (the queue's "
        f"ran:* keys)"
    )
    dead = replies.dead_letter(held, keys.REASON_REPLAYED, text, admitted.data)
    info = ErrorInfo("dead_letter", "DeadLetter", text)
    settled = replies.error(held, message.client, message.id, info, "replayed", dead)
    settled.reply_ttl_s = keys.reply_ttl_s(message.ttl_ms)
    return settled


def memory_refused(
    held: Held, admitted: Admitted, error: Any, replies: Replies, *, release: bool
) -> Settled:
    """Refuse a task whose claim Redis refused (an error reply): it does not run unrecorded,
    and its client is told what Redis said. ``release``: this entry's claim was written
    (only the mark's read failed), and is released with it."""
    message = admitted.message
    text = (
        f"Redis refused to record task {message.id} of {message.function!r} in the replay "
        f"memory ({error}): not run. If this is OOM, Redis is at maxmemory: raise maxmemory, "
        f"or make sure clients read their replies; the queue needs maxmemory-policy "
        f"noeviction"
    )
    info = ErrorInfo("redis_refused", "ReplyError", text)
    settled = replies.error(held, message.client, message.id, info, "memory_refused")
    if release:
        settled.memory = admitted.memory
    settled.reply_ttl_s = keys.reply_ttl_s(message.ttl_ms)
    return settled
