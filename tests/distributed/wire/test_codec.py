"""The msgpack codec: exact round trips, limits, numpy without pickle."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from asyncgraph import WireError
from asyncgraph.distributed.wire._codec import EXT_NDARRAY, check_packable, pack, unpack
from asyncgraph.distributed.wire._limits import Limits


def test_round_trip_keeps_types_exactly() -> None:
    value = {
        "s": "é",
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 0.1,
        "b": True,
        "n": None,
        "bytes": b"\x00\xff",
        "l": [1, [2.5]],
        "t": (1, ("x", [2])),
        "d": {"k": (3,)},
    }
    assert unpack(pack(value)) == value
    assert type(unpack(pack((1, 2)))) is tuple


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([True, False]),
        np.arange(4, dtype=">i8"),
        np.zeros((0, 3), dtype=np.complex128),
        np.array(2.5),
        np.array(7, dtype=">u2"),
        np.arange(12, dtype=">f8").reshape(3, 4).T,
        np.arange(3, dtype="<c8"),
    ],
    ids=["2d", "bool", "big-endian", "empty", "0-d", "0-d big-endian", "transposed", "complex"],
)
def test_numpy_arrays_keep_shape_dtype_and_bytes(arr: np.ndarray) -> None:
    back = unpack(pack(arr))
    assert back.dtype.str == arr.dtype.str  # byte order included
    assert back.shape == arr.shape
    assert back.tobytes() == arr.tobytes() and np.array_equal(back, arr)
    back[...] = 0  # writeable copy, not a view of the message


def test_numpy_scalars_and_strings() -> None:
    scalar = unpack(pack(np.float16(1.5)))
    assert type(scalar) is np.float16 and scalar == 1.5
    assert unpack(pack([np.str_("é"), np.bytes_(b"\x00x")])) == ["é", b"\x00x"]
    assert type(unpack(pack(np.str_("a")))) is str


def test_int_keys_travel_and_other_keys_are_refused_on_both_sides() -> None:
    value = {"s": {1: "one", -2: [3.0]}, "nested": [({2**40: None},)]}
    assert unpack(pack(value)) == value
    for bad in ({1.5: 0}, {(1, 2): 0}, {True: 0}, {None: 0}, {b"b": 0}, {"ok": [{2.0: 1}]}):
        with pytest.raises(TypeError, match="must be str or int"):
            pack(bad)
        data = msgpack.packb(bad, use_bin_type=True, default=list)
        with pytest.raises(WireError):
            unpack(data)
    with pytest.raises(TypeError, match=r"ctx\['a'\]\[0\] has a key 1.5"):
        check_packable({"a": [{1.5: 0}], "b": {3: 0}}, "ctx")


def test_object_arrays_and_unknown_types_are_refused_on_send() -> None:
    with pytest.raises(TypeError, match="cannot cross the wire"):
        pack(np.array([object()]))
    with pytest.raises(TypeError, match="set"):
        pack({"a": {1}})
    with pytest.raises(TypeError, match=r"ctx\['a'\]\[1\]"):
        check_packable({"a": [1, {2}]}, "ctx")


def test_dtype_outside_the_whitelist_is_a_wire_error() -> None:
    body = msgpack.packb(["|O", [1], b"\x00" * 8], use_bin_type=True)
    data = msgpack.packb(msgpack.ExtType(EXT_NDARRAY, body))
    with pytest.raises(WireError, match="not allowed"):
        unpack(data)
    body = msgpack.packb(["<f8", [3], b"\x00" * 8], use_bin_type=True)
    with pytest.raises(WireError, match="does not match"):
        unpack(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, body)))


@pytest.mark.parametrize(
    ("data", "limits", "reason"),
    [
        (b"x" * 101, Limits(max_message_bytes=100), "above the limit"),
        (msgpack.packb("x" * 50), Limits(max_str_len=10), "not valid msgpack"),
        (msgpack.packb(list(range(50))), Limits(max_container_len=10), "not valid msgpack"),
        (msgpack.packb([[[[[1]]]]]), Limits(max_depth=3), "deeper"),
        (msgpack.packb(msgpack.ExtType(99, b"")), Limits(), "unknown msgpack extension"),
        (b"\x91" * 10, Limits(), "not valid msgpack"),
        (msgpack.packb({1.5: 2}), Limits(), "keys must be str or int"),
        (b"\xc1", Limits(), "not valid msgpack"),
    ],
)
def test_limits_and_garbage_raise_wire_error(data: bytes, limits: Limits, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        unpack(data, limits)


def test_deep_tuple_extensions_are_bounded() -> None:
    value: object = 1
    for _ in range(100):
        value = (value,)
    with pytest.raises(WireError, match="deeper"):
        unpack(pack(value))


def test_depth_and_keys_are_checked_through_maps_tuples_and_lists() -> None:
    # Exactly at the limit passes; one level more is refused, whatever the containers.
    at_limit = msgpack.packb({"a": [{"b": [1]}]})  # 4 containers deep
    assert unpack(at_limit, Limits(max_depth=4)) == {"a": [{"b": [1]}]}
    with pytest.raises(WireError, match="deeper than 3"):
        unpack(at_limit, Limits(max_depth=3))
    # A bad key below a tuple (extension) and below map values, not only at the top.
    for bad in ([({1.5: 0},)], {"x": {"y": [{b"k": 1}]}}):
        data = msgpack.packb(
            bad,
            use_bin_type=True,
            strict_types=True,
            default=lambda t: msgpack.ExtType(1, msgpack.packb(list(t), use_bin_type=True)),
        )
        with pytest.raises(WireError, match="keys must be str or int"):
            unpack(data)
    # Lists of plain values at the deepest allowed level cost no walk of their items.
    assert unpack(pack({"p": [list(range(1000))]}), Limits(max_depth=3)) == {
        "p": [list(range(1000))]
    }


def test_the_number_of_arrays_and_maps_is_bounded_while_decoding() -> None:
    # 7 MiB of empty arrays: ~550 MB once decoded, were it decoded (issue #11 point 4).
    count = 7 * 1024 * 1024
    flood = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    with pytest.raises(WireError, match="more than 100000 arrays and maps"):
        unpack(flood, Limits(max_container_len=count))
    # Inside tuple extensions and maps too, and a message within the budget decodes.
    nested = pack({"a": [(i, {"k": []}) for i in range(40)]})
    assert len(unpack(nested)["a"]) == 40
    with pytest.raises(WireError, match="max_containers"):
        unpack(nested, Limits(max_containers=100))
