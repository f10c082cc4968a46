"""Versioned message types of the worker protocol, validated on receipt.

Three kinds travel, each a msgpack map with the protocol version ``v``, its
kind ``k`` and its queue ``q``:

``task``   client -> workers. ``c`` client id, ``id`` task id, ``fn`` registered
           function name, ``fp`` its fingerprint, ``op`` "backward" or
           "forward", ``ttl`` milliseconds the client waits from enqueueing,
           ``p`` the op's payload (ctx state and gradients, or arguments);
           optional ``x``: an opaque metadata map from the client's task hooks
           (e.g. the trace context of the node that sent it).
``reply``  worker -> one client. ``c``, ``id``, ``ok``; ``r`` the result when
           ok, else ``err`` = {``kind``, ``type``, ``message``, ``traceback``};
           ``w`` the worker's consumer name; optional ``x``: an opaque metadata
           map, one entry per task hook (``asyncgraph._task_hooks``: e.g. the model
           usage the task spent, for the caller's totals).
``cancel`` client -> workers. ``c``, ``ids``: tasks to skip or stop.

``decode`` raises ``WireError`` naming the first field that is missing or of
the wrong type; the payload's inner structure is checked by ``asyncgraph.distributed.wire._payload``.
``peek_ids`` reads just the client and task ids of a message that failed to
decode, so that its sender can be told at once (see the worker and the client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from asyncgraph import WireError
from asyncgraph.distributed.wire._codec import DEFAULT_LIMITS, Limits, pack, unpack
from asyncgraph.distributed.wire._keys import PROTOCOL_VERSION, is_client_id
from asyncgraph.distributed.wire._signing import Signer

__all__ = [
    "CancelMessage",
    "ErrorInfo",
    "ReplyMessage",
    "TaskMessage",
    "decode",
    "encode",
    "peek_ids",
]

Op = Literal["backward", "forward"]
ErrorKind = Literal[
    "error", "unknown_function", "fingerprint", "dead_letter", "invalid", "redis_refused"
]
_OPS = ("backward", "forward")
_ERROR_KINDS = (
    "error",
    "unknown_function",
    "fingerprint",
    "dead_letter",
    "invalid",
    "redis_refused",
)
_MAX_NAME = 256
_MAX_ID = 64


@dataclass(frozen=True, slots=True)
class TaskMessage:
    queue: str
    client: str
    id: str
    function: str
    fingerprint: str
    op: Op
    ttl_ms: int
    payload: dict[str, Any]
    meta: dict[str, Any] | None = None  # opaque, one entry per task hook (e.g. trace context)

    def to_map(self) -> dict[str, Any]:
        m = {
            "v": PROTOCOL_VERSION,
            "k": "task",
            "q": self.queue,
            "c": self.client,
            "id": self.id,
            "fn": self.function,
            "fp": self.fingerprint,
            "op": self.op,
            "ttl": self.ttl_ms,
            "p": self.payload,
        }
        if self.meta:
            m["x"] = self.meta
        return m


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    kind: ErrorKind
    type: str
    message: str
    traceback: str = ""

    def to_map(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "type": self.type,
            "message": self.message,
            "traceback": self.traceback,
        }


@dataclass(frozen=True, slots=True)
class ReplyMessage:
    queue: str
    client: str
    id: str
    worker: str
    result: Any = None
    error: ErrorInfo | None = None
    meta: dict[str, Any] | None = None  # opaque, one entry per task hook (asyncgraph._task_hooks)

    def to_map(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "k": "reply",
            "q": self.queue,
            "c": self.client,
            "id": self.id,
            "w": self.worker,
            "ok": self.error is None,
        }
        if self.meta:
            m["x"] = self.meta
        if self.error is None:
            m["r"] = self.result
        else:
            m["err"] = self.error.to_map()
        return m


@dataclass(frozen=True, slots=True)
class CancelMessage:
    queue: str
    client: str
    ids: tuple[str, ...]

    def to_map(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "k": "cancel",
            "q": self.queue,
            "c": self.client,
            "ids": list(self.ids),
        }


Message = TaskMessage | ReplyMessage | CancelMessage


def encode(
    message: Message, signer: Signer, limits: Limits = DEFAULT_LIMITS
) -> tuple[bytes, bytes]:
    """``(packed, signature)``; ``TypeError`` if a value cannot travel, ``WireError`` if too big."""
    packed = pack(message.to_map())
    if len(packed) > limits.max_message_bytes:
        raise WireError(
            f"{message.to_map()['k']} message is {len(packed)} bytes, above the limit of "
            f"{limits.max_message_bytes}; send less data or raise max_message_bytes on the "
            f"client and on the workers"
        )
    return packed, signer.sign(packed)


def decode(  # noqa: C901 (one check per message field, in the schema's order)
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
    version = m.get("v")
    if version != PROTOCOL_VERSION:
        raise WireError(
            f"protocol version {version!r:.20} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same asyncgraph version on clients and workers"
        )
    if _str(m, "q", _MAX_NAME) != queue:
        raise WireError(f"message is for queue {m['q']!r}, not {queue!r}")
    client = _str(m, "c", 32)
    if not is_client_id(client):
        raise WireError(f"field 'c' is not a client id: {client!r}")
    kind = m.get("k")
    if kind == "task":
        op = _str(m, "op", 16)
        if op not in _OPS:
            raise WireError(f"field 'op' must be one of {_OPS}, got {op!r}")
        ttl = _int(m, "ttl")
        if ttl <= 0:
            raise WireError(f"field 'ttl' must be positive, got {ttl}")
        payload = m.get("p")
        if not isinstance(payload, dict):
            raise WireError("field 'p' must be a map")
        return TaskMessage(
            queue,
            client,
            _str(m, "id", _MAX_ID),
            _str(m, "fn", _MAX_NAME),
            _str(m, "fp", _MAX_ID),
            op,  # type: ignore[arg-type]
            ttl,
            payload,
            _meta(m),
        )
    if kind == "reply":
        ok = m.get("ok")
        if not isinstance(ok, bool):
            raise WireError("field 'ok' must be a bool")
        error = None
        if not ok:
            err = m.get("err")
            if not isinstance(err, dict):
                raise WireError("field 'err' must be a map")
            ekind = _str(err, "kind", 32)
            if ekind not in _ERROR_KINDS:
                raise WireError(f"error kind {ekind!r} is unknown")
            error = ErrorInfo(
                ekind,  # type: ignore[arg-type]
                _str(err, "type", _MAX_NAME),
                _str(err, "message", limits.max_str_len),
                _str(err, "traceback", limits.max_str_len),
            )
        return ReplyMessage(
            queue,
            client,
            _str(m, "id", _MAX_ID),
            _str(m, "w", _MAX_NAME),
            m.get("r"),
            error,
            _meta(m),
        )
    if kind == "cancel":
        ids = m.get("ids")
        if not isinstance(ids, list) or not all(
            isinstance(i, str) and len(i) <= _MAX_ID for i in ids
        ):
            raise WireError("field 'ids' must be a list of task ids")
        return CancelMessage(queue, client, tuple(ids))
    raise WireError(f"message kind {kind!r:.20} is unknown")


_HEADER = ("q", "k", "c", "id")


def peek_ids(packed: Any, queue: str, kind: str) -> tuple[str, str] | None:
    """``(client, task id)`` of a ``kind`` message of ``queue``, read without decoding it all.

    For a message that ``decode`` refused: only the top-level fields ``q``, ``k``,
    ``c`` and ``id`` are parsed, every other value is skipped unread, so a broken
    payload or a limit exceeded elsewhere does not matter. None when those fields
    are missing or invalid. What it returns only addresses an error report; the
    caller decides whether the message deserves one (e.g. only if its signature
    checked out).
    """
    if not isinstance(packed, bytes) or not packed:
        return None
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        max_buffer_size=len(packed),
        max_str_len=_MAX_NAME,
        max_bin_len=_MAX_NAME,
        max_array_len=len(packed),
        max_map_len=len(packed),
        max_ext_len=len(packed),
    )
    unpacker.feed(packed)
    found: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if isinstance(key, str) and key in _HEADER:
                found[key] = unpacker.unpack()
                if len(found) == len(_HEADER):
                    break
            else:
                unpacker.skip()
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError):
        pass  # a truncated or broken message: use what was read before the break
    client, task_id = found.get("c"), found.get("id")
    if (
        found.get("q") != queue
        or found.get("k") != kind
        or not isinstance(client, str)
        or not is_client_id(client)
        or not isinstance(task_id, str)
        or not 0 < len(task_id) <= _MAX_ID
    ):
        return None
    return client, task_id


_MAX_META_ENTRIES = 16


def _meta(m: dict[str, Any]) -> dict[str, Any] | None:
    """The reply's metadata map: names to values, opaque here (task hooks read them)."""
    meta = m.get("x")
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > _MAX_META_ENTRIES:
        raise WireError(f"field 'x' must be a map of at most {_MAX_META_ENTRIES} entries")
    for key in meta:
        if not isinstance(key, str) or not 0 < len(key) <= 32:
            raise WireError(f"metadata name {key!r:.40} is not a string of 1 to 32 characters")
    return meta


def _str(m: dict[str, Any], key: str, max_len: int) -> str:
    value = m.get(key)
    if not isinstance(value, str):
        raise WireError(f"field {key!r} must be a str, got {type(value).__name__}")
    if len(value) > max_len:
        raise WireError(f"field {key!r} is longer than {max_len} characters")
    return value


def _int(m: dict[str, Any], key: str) -> int:
    value = m.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"field {key!r} must be an int, got {type(value).__name__}")
    return value
