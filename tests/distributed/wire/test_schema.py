"""Messages: versioned, validated on receipt, optionally signed."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import (
    CancelMessage,
    ErrorInfo,
    ReplyMessage,
    TaskMessage,
    decode,
    encode,
    peek_ids,
)
from asyncgraph.distributed.wire._signing import Signer

CLIENT = "ab" * 16
TASK = TaskMessage("q", CLIENT, "1f", "m:F", "0123", "backward", 1000, {"g": [None]})


@pytest.mark.parametrize(
    "message",
    [
        TASK,
        ReplyMessage("q", CLIENT, "1f", "w1", [[1.0, "r"]]),
        ReplyMessage("q", CLIENT, "1f", "w1", error=ErrorInfo("error", "ValueError", "x", "tb")),
        CancelMessage("q", CLIENT, ("1", "2")),
    ],
)
def test_messages_round_trip_signed(message: Any) -> None:
    signer = Signer("s" * 16)
    packed, signature = encode(message, signer)
    assert decode(packed, signature, signer, "q") == message


def test_signature_is_required_and_checked() -> None:
    signer = Signer("s" * 16)
    packed, signature = encode(TASK, signer)
    with pytest.raises(WireError, match="unsigned"):
        decode(packed, b"", signer, "q")
    with pytest.raises(WireError, match="bad HMAC"):
        decode(packed, Signer("t" * 16).sign(packed), signer, "q")
    with pytest.raises(WireError, match="bad HMAC"):
        decode(packed + b"\x00", signature, signer, "q")
    assert decode(packed, b"", Signer(None), "q") == TASK  # no secret: accepted


def test_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Signer("short")


def test_message_for_another_queue_is_refused() -> None:
    packed, signature = encode(TASK, Signer(None))
    with pytest.raises(WireError, match="not 'other'"):
        decode(packed, signature, Signer(None), "other")


def base() -> dict[str, Any]:
    return dict(TASK.to_map())


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"v": 2}, "protocol version"),
        ({"k": "hello"}, "kind"),
        ({"c": "not-hex"}, "client id"),
        ({"id": 5}, "'id' must be a str"),
        ({"fn": "x" * 300}, "longer than"),
        ({"op": "eval"}, "'op' must be one of"),
        ({"ttl": True}, "'ttl' must be an int"),
        ({"ttl": -1}, "positive"),
        ({"p": []}, "'p' must be a map"),
    ],
)
def test_invalid_fields_are_named(change: dict[str, Any], reason: str) -> None:
    message = base()
    message.update(change)
    with pytest.raises(WireError, match=reason):
        decode(msgpack.packb(message), None, Signer(None), "q")
    del message["v"]
    with pytest.raises(WireError):
        decode(msgpack.packb(message), None, Signer(None), "q")


def test_too_large_message_is_refused_on_send() -> None:
    from asyncgraph.distributed.wire._codec import Limits

    big = TaskMessage("q", CLIENT, "1", "m:F", "0", "backward", 1, {"g": ["x" * 2000]})
    with pytest.raises(WireError, match="max_message_bytes"):
        encode(big, Signer(None), Limits(max_message_bytes=1000))


def test_key_names_share_the_queue_hash_tag() -> None:
    assert keys.task_stream("grads") == "asyncgraph:{grads}:tasks"
    assert keys.reply_stream("grads", CLIENT).startswith("asyncgraph:{grads}:reply:")
    with pytest.raises(ValueError):
        keys.reply_stream("grads", "../../etc")
    with pytest.raises(ValueError, match="queue name"):
        keys.check_queue_name("a b")


def test_ids_of_a_message_that_does_not_decode_can_be_peeked() -> None:
    message = base()
    message["p"] = {"ctx": {1.5: "float key"}, "x": msgpack.ExtType(99, b"?")}
    packed = msgpack.packb(message)
    with pytest.raises(WireError):
        decode(packed, None, Signer(None), "q")
    assert peek_ids(packed, "q", "task") == (CLIENT, "1f")
    assert peek_ids(packed, "other", "task") is None
    assert peek_ids(packed, "q", "reply") is None
    assert peek_ids(b"\x81\xa1c", "q", "task") is None  # truncated
    assert peek_ids(msgpack.packb([1, 2]), "q", "task") is None
    assert peek_ids(msgpack.packb({**message, "c": "not-a-client"}), "q", "task") is None
    assert peek_ids(msgpack.packb({**message, "id": 5}), "q", "task") is None


def test_a_reply_carries_an_opaque_metadata_map_of_bounded_shape() -> None:
    import msgpack

    from asyncgraph.distributed.wire._schema import ReplyMessage, decode, encode
    from asyncgraph.distributed.wire._signing import Signer

    signer = Signer(None)
    reply = ReplyMessage("q", "c" * 32, "1", "w", 1.0, meta={"models": {"requests": 2}, "x": [1]})
    packed, signature = encode(reply, signer)
    assert decode(packed, signature, signer, "q").meta == {"models": {"requests": 2}, "x": [1]}
    for bad in ({"": 1}, {"n" * 33: 1}, {str(i): i for i in range(17)}, [1]):
        m = msgpack.unpackb(packed)
        m["x"] = bad
        with pytest.raises(WireError, match=r"'x'|metadata name"):
            decode(msgpack.packb(m), b"", signer, "q")
