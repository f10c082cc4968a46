"""Messages: versioned, validated on receipt, optionally signed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import msgpack
import pytest

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire import _schema as schema
from asyncgraph.distributed.wire._fields import fields_of, wire
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
EXPIRY_MS = 1_795_575_131_132  # a task's signed expiry: Redis ms (TIME at sending plus ttl)
TASK = TaskMessage(
    "q", CLIENT, "1f", "m:F", "0123", "backward", 1000, {"g": [None]}, expiry_ms=EXPIRY_MS
)


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
        ({"v": 1}, "protocol version"),  # version 1 had no signed expiry: refused
        ({"v": 3}, "protocol version"),
        ({"k": "hello"}, "kind"),
        ({"c": "not-hex"}, "client id"),
        ({"id": 5}, "'id' must be a str"),
        ({"fn": "x" * 300}, "longer than"),
        ({"op": "eval"}, "'op' must be one of"),
        ({"ttl": True}, "'ttl' must be an int"),
        ({"ttl": -1}, "positive"),
        ({"p": []}, "'p' must be a map"),
        ({"exp": 0}, "positive"),
        ({"exp": "soon"}, "'exp' must be an int"),
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


def test_a_task_without_its_signed_expiry_is_refused() -> None:
    message = base()
    del message["exp"]
    with pytest.raises(WireError, match="field 'exp' is missing"):
        decode(msgpack.packb(message), None, Signer(None), "q")


def test_too_large_message_is_refused_on_send() -> None:
    from asyncgraph.distributed.wire._limits import Limits

    big = TaskMessage(
        "q", CLIENT, "1", "m:F", "0", "backward", 1, {"g": ["x" * 2000]}, expiry_ms=EXPIRY_MS
    )
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


# -- the protocol declared once ------------------------------------------------------------
# Bytes written by the encoder before the fields were declared on the classes (the hand-written
# to_map of each kind): the declaration must write the very same maps, key order included.
# Changed once, deliberately, for protocol version 2: every message's "v" is 2 (a1 76 02), and
# a task's map has one entry more (8a -> 8b, 8b -> 8c), its signed expiry "exp" right after
# "ttl" (a3 657870 cf <8 bytes>); nothing else moved.
WIRE_BYTES = [
    (
        TASK,
        "8ba17602a16ba47461736ba171a171a163d9206162616261626162616261626162616261626162616261"
        "626162616261626162a26964a23166a2666ea36d3a46a26670a430313233a26f70a86261636b77617264"
        "a374746ccd03e8a3657870cf000001a2109e2bfca17081a16791c0",
    ),
    (
        TaskMessage(
            "q",
            CLIENT,
            "1f",
            "m:F",
            "0123",
            "forward",
            1000,
            {},
            {"trace": {"a": "b"}},
            expiry_ms=EXPIRY_MS,
        ),
        "8ca17602a16ba47461736ba171a171a163d9206162616261626162616261626162616261626162616261"
        "626162616261626162a26964a23166a2666ea36d3a46a26670a430313233a26f70a7666f7277617264a3"
        "74746ccd03e8a3657870cf000001a2109e2bfca17080a17881a5747261636581a161a162",
    ),
    (
        ReplyMessage("q", CLIENT, "1f", "w1", None, meta={"m": 1}),
        "89a17602a16ba57265706c79a171a171a163d92061626162616261626162616261626162616261626162"
        "61626162616261626162a26964a23166a177a27731a26f6bc3a17881a16d01a172c0",
    ),
    (
        ReplyMessage("q", CLIENT, "1f", "w1", error=ErrorInfo("error", "ValueError", "x", "tb")),
        "88a17602a16ba57265706c79a171a171a163d92061626162616261626162616261626162616261626162"
        "61626162616261626162a26964a23166a177a27731a26f6bc2a365727284a46b696e64a56572726f72a4"
        "74797065aa56616c75654572726f72a76d657373616765a178a974726163656261636ba27462",
    ),
    (
        CancelMessage("q", CLIENT, ("1", "2")),
        "85a17602a16ba663616e63656ca171a171a163d920616261626162616261626162616261626162616261"
        "6261626162616261626162a369647392a131a132",
    ),
]


@pytest.mark.parametrize(("message", "packed"), WIRE_BYTES)
def test_the_declared_messages_travel_as_the_same_bytes(message: Any, packed: str) -> None:
    assert encode(message, Signer(None))[0].hex() == packed
    assert decode(bytes.fromhex(packed), None, Signer(None), "q") == message


@dataclass(frozen=True, slots=True)
class PrioritizedTask(TaskMessage):
    """A task with one field more, declared in one place: the line below."""

    priority: int = field(
        kw_only=True, metadata=wire("pri", "positive int", 10, doc="1 (first) to 10")
    )


def test_a_field_added_in_one_place_round_trips_with_its_bound_enforced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(schema.MESSAGE_KINDS, "task", PrioritizedTask)
    signer = Signer("s" * 16)
    message = PrioritizedTask(
        "q",
        CLIENT,
        "1f",
        "m:F",
        "0123",
        "backward",
        1000,
        {"g": [None]},
        expiry_ms=EXPIRY_MS,
        priority=3,
    )
    packed, signature = encode(message, signer)
    assert msgpack.unpackb(packed)["pri"] == 3
    assert decode(packed, signature, signer, "q") == message
    assert peek_ids(packed, "q", "task") == (CLIENT, "1f")
    m = msgpack.unpackb(packed)
    for value, reason in [(11, "'pri' must be at most 10, got 11"), ("3", "'pri' must be an int")]:
        with pytest.raises(WireError, match=reason):
            decode(msgpack.packb({**m, "pri": value}), None, Signer(None), "q")
    del m["pri"]
    with pytest.raises(WireError, match="field 'pri' is missing"):
        decode(msgpack.packb(m), None, Signer(None), "q")
    row = "| task | `pri` | positive int | 1 to 10 | required | 1 (first) to 10 |"
    assert row in schema.protocol_table().splitlines()


def test_the_protocol_table_in_the_fleet_guide_is_the_declared_one() -> None:
    page = (Path(__file__).parents[3] / "docs" / "guide" / "fleet.md").read_text()
    start = page.index("-->", page.index("<!-- protocol table:")) + len("-->")
    documented = page[start : page.index("<!-- end of protocol table -->")].strip()
    assert documented == schema.protocol_table().strip(), (
        "docs/guide/fleet.md's protocol table differs from the declared messages: paste "
        "the output of asyncgraph.distributed.wire._schema.protocol_table() between its markers"
    )


def test_error_kinds_are_declared_once_and_checked_on_receipt() -> None:
    assert schema.ERROR_KINDS == get_args(schema.ErrorKind)
    for kind in schema.ERROR_KINDS:
        reply = ReplyMessage("q", CLIENT, "1", "w", error=ErrorInfo(kind, "T", "text"))
        assert decode(encode(reply, Signer(None))[0], None, Signer(None), "q") == reply
    m = msgpack.unpackb(encode(reply, Signer(None))[0])
    m["err"]["kind"] = "oops"
    with pytest.raises(WireError, match=r"field 'err.kind' must be one of .*'oops'"):
        decode(msgpack.packb(m), None, Signer(None), "q")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"r": None}, "field 'r' is missing"),
        ({"ok": False}, "field 'err' is missing"),
        ({"ok": False, "err": ["x"]}, "field 'err' must be a map, got list"),
        ({"ok": False, "err": {"kind": "error", "type": "T"}}, "field 'err.message' is missing"),
        ({"ok": 1}, "field 'ok' must be a bool"),
        ({"w": None}, "field 'w' must be a str, got NoneType"),
    ],
)
def test_a_reply_carries_its_result_when_ok_and_its_error_when_not(
    change: dict[str, Any], reason: str
) -> None:
    m = msgpack.unpackb(encode(ReplyMessage("q", CLIENT, "1", "w", 2.0), Signer(None))[0])
    for key, value in change.items():
        if value is None and key != "w":
            del m[key]
        else:
            m[key] = value
    with pytest.raises(WireError, match=reason):
        decode(msgpack.packb(m), None, Signer(None), "q")


@pytest.mark.parametrize(
    ("ids", "reason"),
    [
        (["1", 2], "'ids' must be a list of task ids of 1 to 64 characters, got an item 2"),
        (["1", "x" * 65], "1 to 64 characters, got an item 'xxx"),
        (["", "1"], "1 to 64 characters, got an item ''"),
        ({"1": 1}, "'ids' must be a list of task ids, got dict"),
    ],
)
def test_cancelled_ids_are_task_ids(ids: list[Any], reason: str) -> None:
    m = CancelMessage("q", CLIENT, ("1",)).to_map()
    m["ids"] = ids
    with pytest.raises(WireError, match=reason):
        decode(msgpack.packb(m), None, Signer(None), "q")


def test_peek_checks_the_ids_as_decode_does() -> None:
    for task_id in ("", "x" * 65, None):
        packed = msgpack.packb({**base(), "id": task_id})
        assert peek_ids(packed, "q", "task") is None
        with pytest.raises(WireError, match="'id'"):
            decode(packed, None, Signer(None), "q")
    assert peek_ids(msgpack.packb(base()), "q", "cancel") is None  # a cancel names no task id
    assert peek_ids(msgpack.packb(base()), "q", "nonsense") is None


def test_every_message_names_its_queue_and_kind_inside_the_signed_bytes() -> None:
    # What _signing's promise rests on: a signed message cannot move to another queue or kind.
    for cls in schema.MESSAGE_KINDS.values():
        keys_of = {f.key: f for f in fields_of(cls)}
        assert keys_of["q"].required and not keys_of["q"].when
    for message, _ in WIRE_BYTES:
        assert {"v", "k", "q"} <= msgpack.unpackb(encode(message, Signer(None))[0]).keys()


def test_a_declaration_that_cannot_work_is_refused() -> None:
    @dataclass(frozen=True)
    class Undeclared:
        a: int

    @dataclass(frozen=True)
    class OptionalWithDefault:
        a: int = field(default=0, metadata=wire("a", "positive int", required=False))

    @dataclass(frozen=True)
    class WhenLater:
        a: int = field(metadata=wire("a", "positive int", when=("b", True)))
        b: bool = field(metadata=wire("b", "bool"))

    @dataclass(frozen=True)
    class KeyTwice:
        a: int = field(metadata=wire("a", "positive int"))
        b: int = field(metadata=wire("a", "positive int"))

    for cls, reason in [
        (Undeclared, "no wire"),
        (OptionalWithDefault, "default must be None"),
        (WhenLater, "earlier field"),
        (KeyTwice, "'a' is taken"),
    ]:
        with pytest.raises(TypeError, match=reason):
            fields_of(cls)
