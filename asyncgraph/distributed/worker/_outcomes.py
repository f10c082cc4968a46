"""What settles a task: the Redis commands of its reply, dead letter and acknowledgement.

Pure: building them needs no Redis (``ReplyWriter`` writes them). Every task a worker
reads ends as exactly one ``Settled``: answered, refused, dead-lettered, skipped.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncgraph import WireError
from asyncgraph._redact import redact
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import Limits
from asyncgraph.distributed.wire._schema import (
    ErrorInfo,
    ReplyMessage,
    TaskMessage,
    encode,
    peek_ids,
)
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._metrics import Metrics

__all__ = ["Held", "Memory", "Replies", "Settled"]

log = logging.getLogger("asyncgraph.distributed.worker")

MAX_ORIGINAL = 65_536
MAX_TRACEBACK = 32_768
# Of an entry nobody vouches for (forged, malformed, oversize), a dead letter keeps this
# much of the message and of the error text: enough to tell what it was, while a flood of
# garbage costs Redis a few hundred bytes an entry, not a copy of each.
UNTRUSTED_ORIGINAL = 256
UNTRUSTED_TEXT = 512
UNTRUSTED_REASONS = frozenset({keys.REASON_FORGED, keys.REASON_MALFORMED, keys.REASON_OVERSIZE})
DEAD_ENTRY_OVERHEAD = 64  # bytes Redis spends on a stream entry besides its fields, about
DEAD_LOG_EVERY_S = 1.0  # one log line per reason this often at most; the metric counts all


def dead_maxlen(entry_bytes: int) -> int:
    """The MAXLEN of a dead letter of ``entry_bytes``: the stream keeps ``keys.DEAD_MAXLEN``
    entries at most, and no more entries of this size than ``keys.DEAD_MAX_BYTES`` holds.

    Each XADD trims exactly to its own length, so the stream holds at most
    ``DEAD_MAX_BYTES`` of entries as big as the last big one plus ``DEAD_MAXLEN``
    smaller ones after it.
    """
    return max(1, min(keys.DEAD_MAXLEN, keys.DEAD_MAX_BYTES // max(entry_bytes, 1)))


@dataclass(eq=False)
class Held:
    """A task this worker holds: read, not yet acknowledged."""

    entry_id: bytes
    key: tuple[str, str] | None = None
    deadline: float = 0.0
    delivery: int = 1
    # Of the runner (``_runner``): its task's cancel scope once it began, why it was stopped.
    scope: anyio.CancelScope | None = None
    stopped: str | None = None


@dataclass(frozen=True, slots=True)
class Memory:
    """Where the replay memory keeps one task (NOTE [Replays] in ``worker._admission``):
    its claim (``field`` of the hash ``claims``) and its mark (bit ``bit`` of the bitmap
    ``answered``), both kept until ``expire_at_ms`` of the Redis clock."""

    claims: str
    field: str
    answered: str
    bit: int
    expire_at_ms: int


@dataclass(eq=False)
class Settled:
    """How ``held`` ends: ``outcome`` (a metrics label) and the commands to write with its XACK.

    ``memory``: the task's place in the replay memory, when settling it releases its claim
    (and marks it answered, if ``answered``), in the same transaction as its reply.
    ``reply_ttl_s``: how long its client's reply stream is kept after the write.
    """

    held: Held
    outcome: str
    commands: list[list[Any]] = field(default_factory=list)
    reply_stream: str | None = None
    client: str | None = None  # whom the reply goes to (None: no reply)
    task_id: str | None = None
    refusals: int = 0  # times Redis refused to write it (e.g. OOM)
    memory: Memory | None = None
    answered: bool = False
    reply_ttl_s: int = keys.REPLY_TTL_S


class Replies:
    """Builds the ``Settled`` of each way a task can end, for one worker of one queue."""

    def __init__(self, queue: str, consumer: str, signer: Signer, limits: Limits, metrics: Metrics):
        self.queue = queue
        self.consumer = consumer
        self.signer = signer
        self.limits = limits
        self.metrics = metrics
        self.dead_stream = keys.dead_stream(queue)
        # reason -> (when its last line was logged, dead letters not logged since)
        self._dead_logged: dict[str, tuple[float, int]] = {}

    def settled(self, held: Held, outcome: str, commands: list[list[Any]] | None = None) -> Settled:
        return Settled(held, outcome, commands or [])

    def reply(
        self,
        held: Held,
        client: str,
        task_id: str,
        packed: bytes,
        signature: bytes,
        outcome: str,
        *extra: list[Any],
    ) -> Settled:
        stream = keys.reply_stream(self.queue, client)
        xadd = [
            "XADD",
            stream,
            "*",
            keys.F_MESSAGE,
            packed,
            keys.F_SIGNATURE,
            signature,
            keys.F_TASK_HINT,
            task_id,
        ]
        return Settled(held, outcome, [xadd, *extra], stream, client, task_id)

    def error(
        self,
        held: Held,
        client: str,
        task_id: str,
        info: ErrorInfo,
        outcome: str,
        *extra: list[Any],
        meta: dict[str, Any] | None = None,
    ) -> Settled:
        reply = ReplyMessage(self.queue, client, task_id, self.consumer, error=info, meta=meta)
        packed, signature = encode(reply, self.signer)
        return self.reply(held, client, task_id, packed, signature, outcome, *extra)

    def stopped(self, held: Held, why: str, meta: dict[str, Any] | None = None) -> Settled:
        """A task stopped (``why``: ``"cancelled"``, ``"expired"``) before or while it ran.

        A task its client cancelled gets a short reply (kind ``cancelled``), which that
        client waits for: ``meta`` is what the task's hooks report (the model usage of its
        calls before the cancel, cut ones included; NOTE [One meter] in
        ``asyncgraph.models``). Any other stop settles it without a reply.
        """
        if why != "cancelled" or held.key is None:
            return self.settled(held, why)
        client, task_id = held.key
        info = ErrorInfo(
            "cancelled",
            "Cancelled",
            f"task {task_id} was cancelled by its client; worker {self.consumer} stopped it",
        )
        return self.error(held, client, task_id, info, "cancelled", meta=meta)

    def refused(
        self, held: Held, client: str, task_id: str, text: str, *extra: list[Any]
    ) -> Settled:
        """The client's answer for a task this worker will not run (``invalid``)."""
        info = ErrorInfo(
            "invalid",
            "WireError",
            f"worker {self.consumer} of queue {self.queue!r} refused the task: {text}",
        )
        return self.error(held, client, task_id, info, "rejected", *extra)

    def result(
        self,
        held: Held,
        message: TaskMessage,
        data: dict[Any, Any],
        result: Any,
        error: BaseException | None,
        meta: dict[str, Any] | None = None,
    ) -> Settled:
        """The reply to a task that ran: its result, or its error with this worker's traceback."""
        if error is not None:
            # Redacted here, where it leaves the worker: the client raises it, the dead
            # letter keeps it, `asyncgraph status` prints it (a URL, this worker's keys).
            text = redact(str(error))
            tb = redact("".join(traceback.format_exception(error)))[-MAX_TRACEBACK:]
            info = ErrorInfo("error", type(error).__qualname__, text[:MAX_TRACEBACK], tb)
            dead = self.dead_letter(
                held, keys.REASON_ERROR, f"{type(error).__qualname__}: {text}\n{tb}", data
            )
            return self.error(held, message.client, message.id, info, "error", dead, meta=meta)
        reply = ReplyMessage(
            self.queue, message.client, message.id, self.consumer, result, meta=meta
        )
        try:
            packed, signature = encode(reply, self.signer, self.limits)
        except (TypeError, WireError) as exc:
            info = ErrorInfo(
                "error",
                type(exc).__qualname__,
                f"{message.function}.{message.op} returned a value that cannot be sent back: {exc}",
            )
            return self.error(held, message.client, message.id, info, "error")
        return self.reply(held, message.client, message.id, packed, signature, "ok")

    def _log_dead_letter(self, held: Held, reason: str, text: str) -> None:
        """Log a dead letter; of a flood (10,000 forged entries), one line per reason a second."""
        now = time.monotonic()
        last, unlogged = self._dead_logged.get(reason, (-DEAD_LOG_EVERY_S, 0))
        if now - last < DEAD_LOG_EVERY_S:
            self._dead_logged[reason] = (last, unlogged + 1)
            return
        self._dead_logged[reason] = (now, 0)
        log.warning(
            "worker %s dead-lettered entry %s (%s): %.300s%s",
            self.consumer,
            held.entry_id.decode(errors="replace"),
            reason,
            text,
            f" ({unlogged} more {reason} dead letter(s) not logged since the last line)"
            if unlogged
            else "",
        )

    def dead_letter(self, held: Held, reason: str, text: str, data: dict[Any, Any]) -> list[Any]:
        """The XADD that dead-letters ``held`` with its reason and (truncated) original message.

        The original and the error text are cut to ``UNTRUSTED_ORIGINAL`` and
        ``UNTRUSTED_TEXT`` for a forged, malformed or oversize entry (up to 64 KiB and
        32 KiB for a task that was verified), and the stream is bounded by bytes as well
        as entries (``dead_maxlen``).
        """
        untrusted = reason in UNTRUSTED_REASONS
        self.metrics.inc("asyncgraph_worker_dead_letters_total", reason=reason)
        self._log_dead_letter(held, reason, text)
        fields: list[Any] = [
            keys.F_REASON,
            reason,
            keys.F_ERROR,
            text[: UNTRUSTED_TEXT if untrusted else MAX_TRACEBACK],
            keys.F_WORKER,
            self.consumer,
            keys.F_TASK,
            held.entry_id,
        ]
        # Whose task it was (for that client's timeout diagnosis): from the message when
        # it can be read, else from the entry's hint. Informational, never trusted.
        original = data.get(keys.F_MESSAGE)
        ids = peek_ids(original, self.queue, "task")
        hint = data.get(keys.F_CLIENT_HINT)
        client = (
            ids[0]
            if ids is not None
            else (hint.decode(errors="replace")[:32] if isinstance(hint, bytes) else None)
        )
        if client is not None and keys.is_client_id(client):
            fields += [keys.F_CLIENT, client]
        if isinstance(original, bytes):
            fields += [
                keys.F_ORIGINAL,
                original[: UNTRUSTED_ORIGINAL if untrusted else MAX_ORIGINAL],
            ]
        size = DEAD_ENTRY_OVERHEAD + sum(
            len(f) if isinstance(f, bytes) else len(str(f).encode()) for f in fields
        )
        return ["XADD", self.dead_stream, "MAXLEN", dead_maxlen(size), "*", *fields]
