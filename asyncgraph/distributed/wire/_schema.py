"""The worker protocol, declared once: three message kinds and the checks on receipt.

Every message is a msgpack map: the protocol version ``v`` and the kind ``k``, then
the fields its class declares, in declaration order. Each field is declared once,
on its class, as ``field(metadata=wire(key, type, bound, ...))`` (see ``_fields``),
and everything else follows from that: ``encode`` writes the map, ``decode``
checks every field's type and bound (``WireError`` names the first field that is
missing or wrong), ``peek_ids`` reads a broken message's address, and
``protocol_table`` renders the table in docs/guide/fleet.md (a test keeps the two
equal). Adding a field is one line on its class, plus its test.

- ``task``: client -> workers: run one function's op;
- ``reply``: worker -> one client: a task's result or error;
- ``cancel``: client -> workers: tasks to skip or stop.

Every message names its queue and kind inside the signed bytes (``_signing``), so
a signed message cannot be replayed into another queue or as another kind; a task
also carries its signed expiry (``exp``), so it cannot be replayed after its deadline. What
a task's payload (``p``) and a reply's result (``r``) hold is declared the same way, in
``_payload`` (``PAYLOADS``), and shown in the same table.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, cast, get_args

import msgpack

from asyncgraph import WireError
from asyncgraph.distributed.wire._codec import pack, unpack
from asyncgraph.distributed.wire._fields import (
    Field,
    check,
    fields_of,
    from_map,
    row,
    table_rows,
    to_map,
    wire,
)
from asyncgraph.distributed.wire._keys import MAX_TTL_MS, PROTOCOL_VERSION
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS, Limits
from asyncgraph.distributed.wire._payload import BACKWARD_RESULT, PAYLOADS
from asyncgraph.distributed.wire._signing import Signer

__all__ = [
    "ERROR_KINDS",
    "MESSAGE_KINDS",
    "OPS",
    "CancelMessage",
    "ErrorInfo",
    "ErrorKind",
    "Message",
    "Op",
    "ReplyMessage",
    "TaskMessage",
    "decode",
    "encode",
    "peek_ids",
    "protocol_table",
]

Op = Literal["backward", "forward"]
# Why a remote task failed: its function raised ("error"); the worker has no such
# function, or other code under its name ("fingerprint"); the task was dead-lettered;
# the worker could not decode or accept it ("invalid"); Redis refused its reply; its
# client cancelled it ("cancelled": the reply reports what the task spent before, in ``x``).
ErrorKind = Literal[
    "error",
    "unknown_function",
    "fingerprint",
    "dead_letter",
    "invalid",
    "redis_refused",
    "cancelled",
]
OPS: tuple[Op, ...] = get_args(Op)
ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)
MAX_NAME = 256  # queue, function and worker names, exception type names
MAX_ID = 64  # task ids and fingerprints
MAX_META_ENTRIES = 16  # task hooks' metadata entries in one message

# In every message, before the fields of its class.
VERSION = Field(
    "v",
    "positive int",
    choices=(PROTOCOL_VERSION,),
    doc="protocol version; another is refused (run one asyncgraph version everywhere)",
)
KIND = Field("k", "str", 16, doc="message kind")


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a task failed, as its reply carries it (``err``)."""

    kind: ErrorKind = field(metadata=wire("kind", "str", choices=ERROR_KINDS, doc="what failed"))
    type: str = field(metadata=wire("type", "str", MAX_NAME, doc="the exception's type name"))
    message: str = field(metadata=wire("message", "str", doc="the error's text"))
    traceback: str = field(
        default="", metadata=wire("traceback", "str", doc="the worker's traceback, or empty")
    )

    def to_map(self) -> dict[str, Any]:
        return to_map(self)


@dataclass(frozen=True, slots=True)
class _Message:
    """What every message holds after ``v`` and ``k``: its queue and its client."""

    kind: ClassVar[str]
    queue: str = field(
        metadata=wire("q", "str", MAX_NAME, doc="the queue; a message for another is refused")
    )
    client: str = field(
        metadata=wire("c", "client id", 32, doc="the client that sent the task or gets the reply")
    )

    def to_map(self) -> dict[str, Any]:
        """The message as the msgpack map that travels."""
        return to_map(self, {VERSION.key: PROTOCOL_VERSION, KIND.key: self.kind})


@dataclass(frozen=True, slots=True)
class TaskMessage(_Message):
    """Client -> workers: run ``op`` of the registered function ``function``."""

    kind: ClassVar[str] = "task"
    id: str = field(
        metadata=wire(
            "id",
            "task id",
            MAX_ID,
            doc="task id, unique per client: the client's task counter in lowercase hex, "
            "at most 16 digits (a worker refuses another id: its replay memory keeps a bit "
            "per number)",
        )
    )
    function: str = field(
        metadata=wire("fn", "str", MAX_NAME, doc="the function's name in the worker's registry")
    )
    fingerprint: str = field(
        metadata=wire("fp", "str", MAX_ID, doc="fingerprint of the function's code")
    )
    op: Op = field(metadata=wire("op", "str", choices=OPS, doc="what to run"))
    ttl_ms: int = field(
        metadata=wire(
            "ttl",
            "positive int",
            MAX_TTL_MS,
            doc="milliseconds the client waits from enqueueing (at most 7 days)",
        )
    )
    # Signed, unlike the stream entry's id (whoever adds the entry picks it): the time a
    # replayed copy of the entry carries is still the sender's. See NOTE [Replays] in
    # ``worker._admission``.
    expiry_ms: int = field(
        kw_only=True,
        metadata=wire(
            "exp",
            "positive int",
            doc="when the task expires, ms of the Redis server's clock (`TIME` at sending "
            "plus `ttl`): a worker settles it unrun after that",
        ),
    )
    payload: dict[str, Any] = field(
        metadata=wire("p", "map", doc="what the op needs: fields `p.*` below, by `op`")
    )
    meta: dict[str, Any] | None = field(
        default=None,
        metadata=wire(
            "x",
            "names map",
            MAX_META_ENTRIES,
            required=False,
            doc="opaque, one entry per task hook (e.g. the sender's trace context)",
        ),
    )


@dataclass(frozen=True, slots=True)
class ReplyMessage(_Message):
    """Worker -> one client: the result of task ``id``, or its ``error``."""

    kind: ClassVar[str] = "reply"
    id: str = field(metadata=wire("id", "task id", MAX_ID, doc="the task answered"))
    worker: str = field(metadata=wire("w", "str", MAX_NAME, doc="the worker's consumer name"))
    # Derived from ``error`` (see __post_init__); on the wire it says which of r and err follows.
    ok: bool = field(
        init=False,
        repr=False,
        compare=False,
        metadata=wire("ok", "bool", doc="whether the task succeeded"),
    )
    meta: dict[str, Any] | None = field(
        default=None,
        kw_only=True,
        metadata=wire(
            "x",
            "names map",
            MAX_META_ENTRIES,
            required=False,
            doc="opaque, one entry per task hook (e.g. the model usage the task spent)",
        ),
    )
    result: Any = field(
        default=None,
        metadata=wire("r", "any", when=("ok", True), doc="the op's result: `r` below, by `op`"),
    )
    error: ErrorInfo | None = field(
        default=None, metadata=wire("err", ErrorInfo, when=("ok", False), doc="why it failed")
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", self.error is None)


@dataclass(frozen=True, slots=True)
class CancelMessage(_Message):
    """Client -> workers: skip or stop these tasks of ``client``."""

    kind: ClassVar[str] = "cancel"
    ids: tuple[str, ...] = field(
        metadata=wire("ids", "list of task ids", MAX_ID, doc="the tasks to skip or stop")
    )


Message = TaskMessage | ReplyMessage | CancelMessage
# The class that decodes each kind (``k``).
MESSAGE_KINDS: dict[str, type[_Message]] = {
    cls.kind: cls for cls in (TaskMessage, ReplyMessage, CancelMessage)
}


def encode(
    message: Message, signer: Signer, limits: Limits = DEFAULT_LIMITS
) -> tuple[bytes, bytes]:
    """``(packed, signature)``; ``TypeError`` if a value cannot travel, ``WireError`` if too big."""
    packed = pack(message.to_map())
    if len(packed) > limits.max_message_bytes:
        raise WireError(
            f"{message.kind} message is {len(packed)} bytes, above the limit of "
            f"{limits.max_message_bytes}; send less data or raise max_message_bytes on the "
            f"client and on the workers"
        )
    return packed, signer.sign(packed)


def decode(
    packed: Any, signature: Any, signer: Signer, queue: str, limits: Limits = DEFAULT_LIMITS
) -> Message:
    """Verify, unpack and validate one message of ``queue``; ``WireError`` says why not."""
    if not isinstance(packed, bytes):
        raise WireError("stream entry has no message field")
    if signature is not None and not isinstance(signature, bytes):
        raise WireError("signature field is not bytes")
    reason = signer.verify(packed, signature)
    if reason is not None:
        raise WireError(reason)
    m = unpack(packed, limits)
    if not isinstance(m, dict):
        raise WireError(f"message is a {type(m).__name__}, not a map")
    version = m.get(VERSION.key)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WireError(
            f"protocol version {version!r:.20} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same asyncgraph version on clients and workers"
        )
    kind = m.get(KIND.key)
    cls = MESSAGE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"message kind {kind!r:.20} is unknown")
    message = from_map(cls, m)
    if message.queue != queue:
        raise WireError(f"message is for queue {message.queue!r}, not {queue!r}")
    return cast(Message, message)


_ADDRESS = ("queue", "client", "id")


def peek_ids(packed: Any, queue: str, kind: str) -> tuple[str, str] | None:
    """``(client, task id)`` of a ``kind`` message of ``queue``, read without decoding it all.

    For a message that ``decode`` refused: only the kind and the fields of
    ``_ADDRESS`` are parsed (checked as ``decode`` checks them), every other value
    is skipped unread, so a broken payload or a limit exceeded elsewhere does not
    matter. None when those fields are missing or invalid, or ``kind`` has no task
    id. What it returns only addresses an error report; the caller decides whether
    the message deserves one (e.g. only if its signature checked out).
    """
    cls: type | None = MESSAGE_KINDS.get(kind)
    plan = _peek_plan(cls) if cls is not None else None
    if plan is None or not isinstance(packed, bytes) or not packed:
        return None
    address, wanted, longest = plan
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        max_buffer_size=len(packed),
        max_str_len=longest,
        max_bin_len=longest,
        max_array_len=len(packed),
        max_map_len=len(packed),
        max_ext_len=len(packed),
    )
    unpacker.feed(packed)
    found: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if isinstance(key, str) and key in wanted:
                found[key] = unpacker.unpack()
                if len(found) == len(wanted):
                    break
            else:
                unpacker.skip()
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError):
        pass  # a truncated or broken message: use what was read before the break
    if found.get(KIND.key) != kind or not wanted <= found.keys():
        return None
    try:
        values = {f.attr: check(f, found[key]) for key, f in address.items()}
    except WireError:
        return None
    if values["queue"] != queue:
        return None
    return values["client"], values["id"]


@functools.cache
def _peek_plan(cls: type) -> tuple[dict[str, Field], frozenset[str], int] | None:
    """The ``_ADDRESS`` fields of ``cls`` by key, all keys to read, the longest str to read."""
    address = {f.key: f for f in fields_of(cls) if f.attr in _ADDRESS}
    if len(address) != len(_ADDRESS):
        return None
    longest = max(f.bound or 0 for f in (KIND, *address.values()))
    return address, frozenset((KIND.key, *address)), longest


def protocol_table() -> str:
    """The protocol as a Markdown table: what docs/guide/fleet.md shows (a test compares)."""
    kinds = dataclasses.replace(KIND, choices=tuple(MESSAGE_KINDS))
    rows = [row(VERSION, "every"), row(kinds, "every"), *table_rows(_Message, "every")]
    common = {f.attr for f in fields_of(_Message)}
    for kind, cls in MESSAGE_KINDS.items():
        rows += table_rows(cls, kind, skip=common)
    for message, where, record in PAYLOADS:
        rows += table_rows(record, message, where)
    rows.append(row(BACKWARD_RESULT, "reply: backward"))
    header = ("message", "key", "type", "bound", "presence", "meaning")
    lines = [header, ("---",) * len(header), *rows]
    return "".join("| " + " | ".join(line) + " |\n" for line in lines)
