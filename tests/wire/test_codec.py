"""The msgpack codec: exact round trips, limits, numpy without pickle."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from asyncgraph import WireError
from asyncgraph.wire._codec import EXT_NDARRAY, Limits, check_packable, pack, unpack


def test_round_trip_keeps_types_exactly() -> None:
    value = {"s": "é", "i": -(2**63), "u": 2**64 - 1, "f": 0.1, "b": True, "n": None,
             "bytes": b"\x00\xff", "l": [1, [2.5]], "t": (1, ("x", [2])), "d": {"k": (3,)}}
    assert unpack(pack(value)) == value
    assert type(unpack(pack((1, 2)))) is tuple


def test_numpy_arrays_and_scalars_round_trip_with_dtype() -> None:
    for arr in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True, False]),
                np.arange(4, dtype=">i8"), np.zeros((0, 3), dtype=np.complex128)):
        back = unpack(pack(arr))
        assert back.dtype == arr.dtype.newbyteorder("<") or back.dtype == arr.dtype
        assert back.shape == arr.shape and np.array_equal(back, arr)
        back[...] = 0  # writeable copy, not a view of the message
    scalar = unpack(pack(np.float16(1.5)))
    assert type(scalar) is np.float16 and scalar == 1.5


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
        (msgpack.packb({1: 2}), Limits(), "not valid msgpack"),
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
