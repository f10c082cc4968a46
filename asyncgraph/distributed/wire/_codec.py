"""msgpack, with limits, for everything that crosses a process boundary.

``pack(obj)`` accepts None, bool, int (64-bit), float, str, bytes, list, tuple,
dict whose keys are str or int, and (when numpy is installed) numpy arrays and
scalars of a whitelisted numeric dtype, in either byte order and of any shape
(0-d included): they come back with the same shape, dtype and bytes. numpy
strings (``np.str_``, ``np.bytes_``) travel as str and bytes. Anything else
raises ``TypeError`` naming where it sits (``check_packable`` finds the
offending path). Tuples stay tuples.

``unpack(data, limits)`` rejects, with ``WireError`` and the reason, a message
larger than ``limits.max_message_bytes``, any string or binary longer than
``limits.max_str_len``, containers longer than ``limits.max_container_len``,
nesting deeper than ``limits.max_depth``, map keys other than str and int (the
same rule as ``pack``), unknown extension types and numpy dtypes outside the
whitelist. Arrays are rebuilt with ``numpy.frombuffer``;
nothing is ever unpickled or imported by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgpack

from asyncgraph import WireError
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS, Limits

__all__ = ["check_packable", "pack", "unpack"]

EXT_TUPLE = 1
EXT_NDARRAY = 2
EXT_NPSCALAR = 3

# Plain numeric dtypes only ('O' object arrays would need pickle), in either byte order:
# an array comes back with the byte order it was sent with.
_DTYPES = frozenset(
    {"|b1", "|i1", "|u1"}
    | {
        order + code
        for order in "<>"
        for code in ("i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16")
    }
)
# Map keys that travel (both sides check): msgpack can carry others, but a float or
# tuple key would come back as something else, or not at all.
_KEY_TYPES = frozenset({str, int})
# Values whose type alone says they hold no map: a list of these needs no key check.
_FLAT = frozenset({str, int, float, bool, bytes, type(None)})
# What unpack builds that holds other values (numpy arrays and scalars do not).
_CONTAINERS = frozenset({dict, list, tuple})


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy


def _default(obj: Any) -> Any:  # noqa: C901 (one branch per msgpack extension type)
    kind = type(obj)
    if kind is tuple:
        return msgpack.ExtType(EXT_TUPLE, _packb(list(obj)))
    if kind.__module__ == "numpy":
        numpy = _numpy()
        if numpy is not None:
            if isinstance(obj, numpy.ndarray):
                dtype = _wire_dtype(obj.dtype)
                # tobytes() is C order whatever the layout; shape and byte order are kept
                # (not ascontiguousarray, which turns a 0-d array into shape (1,)).
                body = _packb([dtype.str, list(obj.shape), obj.tobytes()])
                return msgpack.ExtType(EXT_NDARRAY, body)
            if isinstance(obj, (numpy.str_, numpy.bytes_)):
                return str(obj) if isinstance(obj, str) else bytes(obj)
            if isinstance(obj, numpy.generic):
                dtype = _wire_dtype(obj.dtype)
                body = _packb([dtype.str, numpy.asarray(obj, dtype=dtype).tobytes()])
                return msgpack.ExtType(EXT_NPSCALAR, body)
    # Subclasses (IntEnum, str subclasses, OrderedDict...) travel as their base type.
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, bytes):
        return bytes(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return dict(obj)
    raise TypeError(f"cannot serialize {kind.__name__} ({obj!r:.60}) to msgpack")


def _wire_dtype(dtype: Any) -> Any:
    if dtype.str not in _DTYPES:
        raise TypeError(
            f"numpy dtype {dtype!s} cannot cross the wire (allowed: bool, ints, floats, complex)"
        )
    return dtype


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)  # type: ignore[no-any-return]


def pack(obj: Any) -> bytes:
    """Serialize ``obj``; raise ``TypeError`` (naming the type) if it cannot travel."""
    _check_keys(obj)
    try:
        return _packb(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(str(exc)) from None


def _bad_key(key: Any) -> bool:
    return type(key) not in _KEY_TYPES and not (
        isinstance(key, (str, int)) and not isinstance(key, bool)
    )


def _check_keys(obj: Any) -> None:
    """Raise ``TypeError`` for a map key that is not a str or an int (bool is not an int here).

    Only containers are walked, and the keys, or the values, of a container that
    are all plain are checked in C (``issuperset(map(type, ...))``), so a message
    costs a few microseconds and a long numeric list little more.
    """
    stack = [obj]
    pop = stack.pop
    while stack:
        value = pop()
        if isinstance(value, dict):
            if not _KEY_TYPES.issuperset(map(type, value)):
                for key in value:
                    if _bad_key(key):
                        raise TypeError(
                            f"map key {key!r:.60} ({type(key).__name__}) cannot travel: keys "
                            f"must be str or int"
                        )
            values = value.values()
            if not _FLAT.issuperset(map(type, values)):
                stack += [v for v in values if type(v) not in _FLAT]
        elif isinstance(value, (list, tuple)) and not _FLAT.issuperset(map(type, value)):
            stack += [v for v in value if type(v) not in _FLAT]


def check_packable(obj: Any, where: str) -> None:
    """Raise ``TypeError`` naming the path under ``where`` of the first value that cannot travel."""
    stack: list[tuple[Any, str]] = [(obj, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if _bad_key(key):
                    raise TypeError(
                        f"{path} has a key {key!r:.60} of type {type(key).__name__}; map keys "
                        f"must be str or int to cross the wire"
                    )
                stack.append((item, f"{path}[{key!r}]"))
        else:
            try:
                _packb(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(f"{path}: {exc}") from None


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Deserialize one message; raise ``WireError`` with the reason when it breaks a limit."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise WireError(
            f"message is {len(data)} bytes, above the limit of {limits.max_message_bytes}"
        )
    try:
        if len(data) <= limits.max_containers:
            # Each array or map takes a byte at least: the budget cannot run out, and
            # no hook needs to count them.
            value = _unpackb_small(bytes(data), limits)
        else:
            value = _unpackb(bytes(data), limits, 0, [limits.max_containers])
    except WireError:
        raise
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        RecursionError,
    ) as exc:
        raise WireError(
            f"message is not valid msgpack within limits: {type(exc).__name__}: {exc}"
        ) from None
    _check_depth(value, limits.max_depth)
    return value


def _unpackb(data: bytes, limits: Limits, depth: int, budget: list[int]) -> Any:
    """Unpack ``data``; ``budget[0]``: containers still allowed (counted while decoding)."""
    if depth > limits.max_depth:
        raise WireError(f"message nests deeper than {limits.max_depth} levels")

    def counted(container: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise WireError(
                f"message holds more than {limits.max_containers} arrays and maps "
                f"(max_containers); it was not decoded further"
            )
        return container

    def ext_hook(code: int, body: bytes) -> Any:
        return _ext(code, body, limits, depth + 1, budget)

    return _msgpack_unpackb(data, limits, ext_hook, counted)


def _msgpack_unpackb(
    data: bytes,
    limits: Limits,
    ext_hook: Callable[[int, bytes], Any],
    counted: Callable[[Any], Any] | None,
) -> Any:
    """msgpack's unpackb within ``limits``; ``counted`` sees every array and map built."""
    return msgpack.unpackb(
        data,
        raw=False,
        use_list=True,
        strict_map_key=False,  # int keys are allowed; _check_depth refuses other types
        ext_hook=ext_hook,
        list_hook=counted,
        object_hook=counted,
        max_str_len=limits.max_str_len,
        max_bin_len=limits.max_str_len,
        max_array_len=limits.max_container_len,
        max_map_len=limits.max_container_len,
        max_ext_len=limits.max_message_bytes,
    )


def _ext(code: int, body: bytes, limits: Limits, depth: int, budget: list[int]) -> Any:
    """The value of one msgpack extension, its body unpacked at ``depth``."""
    if code == EXT_TUPLE:
        items = _unpackb(body, limits, depth, budget)
        if not isinstance(items, list):
            raise WireError("tuple extension does not hold an array")
        return tuple(items)
    if code == EXT_NDARRAY:
        return _ndarray(_unpackb(body, limits, depth, budget))
    if code == EXT_NPSCALAR:
        return _npscalar(_unpackb(body, limits, depth, budget))
    raise WireError(f"unknown msgpack extension type {code}")


def _unpackb_small(data: bytes, limits: Limits) -> Any:
    """``_unpackb`` of a message too small to hold more than ``max_containers`` containers."""

    def ext_hook(code: int, body: bytes) -> Any:
        return _ext(code, body, limits, 1, [limits.max_containers])

    return _msgpack_unpackb(data, limits, ext_hook, None)


def _dtype(name: Any) -> Any:
    numpy = _numpy()
    if numpy is None:
        raise WireError("message holds a numpy array but numpy is not installed here")
    if not isinstance(name, str) or name not in _DTYPES:
        raise WireError(f"numpy dtype {name!r:.40} is not allowed on the wire")
    return numpy, numpy.dtype(name)


def _ndarray(body: Any) -> Any:
    if not (
        isinstance(body, list)
        and len(body) == 3
        and isinstance(body[1], list)
        and isinstance(body[2], bytes)
    ):
        raise WireError("malformed numpy array extension")
    numpy, dtype = _dtype(body[0])
    shape = tuple(body[1])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError(f"malformed numpy array shape {shape!r:.60}")
    if math.prod(shape) * dtype.itemsize != len(body[2]):
        raise WireError(
            f"numpy array of shape {shape!r:.60} does not match its {len(body[2])} bytes"
        )
    return numpy.frombuffer(body[2], dtype=dtype).reshape(shape).copy()


def _npscalar(body: Any) -> Any:
    if not (isinstance(body, list) and len(body) == 2 and isinstance(body[1], bytes)):
        raise WireError("malformed numpy scalar extension")
    numpy, dtype = _dtype(body[0])
    if len(body[1]) != dtype.itemsize:
        raise WireError("numpy scalar does not match its dtype's size")
    return numpy.frombuffer(body[1], dtype=dtype)[0]


def _check_depth(value: Any, max_depth: int) -> None:
    """Refuse nesting deeper than ``max_depth`` and map keys other than str and int.

    Walks the containers level by level; a container whose items are all plain is
    checked in C (``issuperset(map(type, ...))``), so a small message costs about a
    microsecond.
    """
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        if depth >= max_depth:
            raise WireError(f"message nests deeper than {max_depth} levels")
        below: list[Any] = []
        for item in level:
            if type(item) is dict:
                if not _KEY_TYPES.issuperset(map(type, item)):
                    key = next(k for k in item if type(k) not in _KEY_TYPES)
                    raise WireError(
                        f"map key {key!r:.60} ({type(key).__name__}) is not allowed: keys "
                        f"must be str or int"
                    )
                item = item.values()
            if not _FLAT.issuperset(map(type, item)):
                below += [x for x in item if type(x) in _CONTAINERS]
        level = below
        depth += 1
