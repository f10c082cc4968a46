"""Field tables: how a record is declared once and mapped to and from the wire.

A wire record is a frozen dataclass whose fields carry a ``Field`` in their
metadata (``dataclasses.field(metadata=wire(...))``): the key it travels under, its
type, its bound and whether it must be present. Everything that reads or writes
the record follows from that one declaration:

- ``to_map(record)``: the msgpack map, keys in declaration order;
- ``from_map(cls, m)``: the record, each field checked against its type and bound,
  ``WireError`` naming the first field that is missing or out of bounds;
- ``check(field, value)``: one field alone (what a peek at a broken message uses);
- ``table_rows(cls)``: the rows of the protocol table in the docs.

Types (``FieldType``), and what ``bound`` means for each:

- ``str``: at most ``bound`` characters (None: the codec's ``Limits.max_str_len``);
- ``task id``: a str of 1 to ``bound`` characters;
- ``client id``: 32 lowercase hex digits (``_keys.is_client_id``);
- ``positive int``: an int (not a bool) from 1 to ``bound`` (None: no maximum);
- ``bool``: True or False;
- ``map``: at most ``bound`` entries (None: the codec's limits);
- ``names map``: at most ``bound`` entries, keys str of 1 to 32 characters, values
  opaque (one entry per task hook);
- ``list of task ids``: each item a ``task id`` of at most ``bound`` characters (a
  tuple in the record);
- ``any``: whatever the codec accepts;
- a record class: a map of that record's own fields (a reply's ``err``).

``choices``, when given, are the only values accepted. A field that is not ``required`` is left out of the map when it is None or empty
and is None when absent; one with ``when=(attribute, value)`` is present only
when that earlier attribute has that value (and required then if ``required``).
Keys the table does not know are ignored, so a field added later is optional to
older readers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, TypeVar

from asyncgraph import WireError
from asyncgraph.distributed.wire._keys import is_client_id

__all__ = [
    "Field",
    "FieldType",
    "check",
    "fields_of",
    "from_map",
    "row",
    "table_rows",
    "to_map",
    "wire",
]

FieldType = Literal[
    "str",
    "task id",
    "client id",
    "positive int",
    "bool",
    "map",
    "names map",
    "list of task ids",
    "any",
]
_WIRE = "asyncgraph.wire"  # the metadata key a dataclass field's Field is stored under
_MAX_META_NAME = 32
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One key of a wire record: its name on the wire, type, bound and presence.

    ``key`` is the map key, ``type`` and ``bound`` what a value may be (see the
    module's docstring), ``required`` whether it must be present, ``doc`` its line in
    the protocol table, ``choices`` the only values allowed (if any), ``when`` the
    ``(attribute, value)`` under which it is present at all. ``attr`` (the record's
    attribute) and ``init`` (whether the record's constructor takes it) are filled
    in by ``fields_of`` from the dataclass field.
    """

    key: str
    type: FieldType | type
    bound: int | None = None
    required: bool = True
    doc: str = ""
    choices: tuple[Any, ...] = ()
    when: tuple[str, Any] | None = None
    attr: str = ""
    init: bool = True


def wire(
    key: str,
    type: FieldType | type,
    bound: int | None = None,
    *,
    required: bool = True,
    doc: str = "",
    choices: tuple[Any, ...] = (),
    when: tuple[str, Any] | None = None,
) -> dict[str, Field]:
    """The metadata declaring a dataclass field's wire form: ``field(metadata=wire(...))``."""
    return {_WIRE: Field(key, type, bound, required, doc, tuple(choices), when)}


def fields_of(cls: type) -> tuple[Field, ...]:
    """The wire fields of the record class ``cls``, in declaration (and wire) order.

    Raises ``TypeError`` for a declaration that cannot work: a dataclass field without
    ``wire`` metadata, an optional field without a None default, a ``when`` naming a
    later attribute, or a key used twice.
    """
    return _fields_of(cls)


@functools.cache
def _fields_of(cls: type) -> tuple[Field, ...]:
    table: list[Field] = []
    for dc_field in dataclasses.fields(cls):
        declared = dc_field.metadata.get(_WIRE)
        if not isinstance(declared, Field):
            raise TypeError(f"{cls.__name__}.{dc_field.name} has no wire(...) metadata")
        if not declared.required and dc_field.default is not None:
            raise TypeError(f"{cls.__name__}.{dc_field.name} is optional: its default must be None")
        if declared.when is not None and declared.when[0] not in {f.attr for f in table}:
            raise TypeError(f"{cls.__name__}.{dc_field.name}: when= must name an earlier field")
        if declared.key in {f.key for f in table}:
            raise TypeError(f"{cls.__name__}.{dc_field.name}: key {declared.key!r} is taken")
        table.append(dataclasses.replace(declared, attr=dc_field.name, init=dc_field.init))
    return tuple(table)


def to_map(record: Any, m: dict[str, Any] | None = None) -> dict[str, Any]:
    """The msgpack map of ``record``: its declared fields in order, after those of ``m``."""
    m = {} if m is None else m
    record_type: type = type(record)  # (functools.cache wants a plain type, for mypy)
    for key, attr, when, optional, convert in _writer(record_type):
        if when is not None and getattr(record, when[0]) != when[1]:
            continue
        value = getattr(record, attr)
        if optional and (value is None or (not value and isinstance(value, _SIZED))):
            continue
        m[key] = value if convert is None else convert(value)
    return m


def from_map(cls: type[R], m: Mapping[Any, Any], where: str = "") -> R:
    """The ``cls`` record that ``m`` holds; ``WireError`` names the first bad field."""
    record_type: type = cls  # (functools.cache wants a plain type, for mypy)
    values: dict[str, Any] = {}
    for key, attr, when, required, checker in _reader(record_type, where):
        if when is not None and values[when[0]] != when[1]:
            continue
        if key in m:
            values[attr] = checker(m[key])
        elif required:
            raise WireError(f"field {where + key!r} is missing")
    for attr in _derived(record_type):
        values.pop(attr, None)
    return cls(**values)


def check(f: Field, value: Any, where: str = "") -> Any:
    """``value`` as field ``f`` of the record (``where`` prefixes its key in errors)."""
    return _checker(f, where)(value)


# What reading and writing a record does per field, worked out once per class rather
# than per message: every task is written and read once on each side.
@functools.cache
def _writer(cls: type) -> tuple[tuple[str, str, Any, bool, Callable[[Any], Any] | None], ...]:
    def convert(f: Field) -> Callable[[Any], Any] | None:
        if isinstance(f.type, type):
            return to_map
        # a tuple would travel as the codec's tuple extension, not as an array
        return list if f.type == "list of task ids" else None

    return tuple((f.key, f.attr, f.when, not f.required, convert(f)) for f in fields_of(cls))


@functools.cache
def _reader(cls: type, where: str) -> tuple[tuple[str, str, Any, bool, Callable[[Any], Any]], ...]:
    return tuple((f.key, f.attr, f.when, f.required, _checker(f, where)) for f in fields_of(cls))


@functools.cache
def _derived(cls: type) -> frozenset[str]:
    """Attributes read from the wire but not passed to the constructor (``init=False``)."""
    return frozenset(f.attr for f in fields_of(cls) if not f.init)


@functools.cache
def _checker(f: Field, where: str) -> Check:
    name = where + f.key
    record = f.type
    if isinstance(record, type):

        def check_record(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _type_error(name, "a map", value)
            return from_map(record, value, f"{name}.")

        return check_record
    check_type = _CHECKS[record](name, f.bound, f.choices)
    if not f.choices or record == "str":  # a str checks its choices itself, in one call
        return check_type
    choices = f.choices

    def check_choice(value: Any) -> Any:
        value = check_type(value)
        if value not in choices:
            raise WireError(f"field {name!r} must be one of {choices}, got {value!r:.40}")
        return value

    return check_choice


def _type_error(name: str, expected: str, value: Any) -> WireError:
    return WireError(f"field {name!r} must be {expected}, got {type(value).__name__}")


# One factory per type: ``(name, bound, choices)`` -> the check of one value, which returns
# the value as the record holds it or raises WireError naming the field.
Check = Callable[[Any], Any]


def _str(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    limit = math.inf if bound is None else bound

    def check_str(value: Any) -> str:
        if not isinstance(value, str):
            raise _type_error(name, "a str", value)
        if len(value) > limit:
            raise WireError(f"field {name!r} is longer than {bound} characters")
        if choices and value not in choices:
            raise WireError(f"field {name!r} must be one of {choices}, got {value!r:.40}")
        return value

    return check_str


def _task_id(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    limit = bound or 0

    def check_task_id(value: Any) -> str:
        if not isinstance(value, str):
            raise _type_error(name, "a str", value)
        if not 0 < len(value) <= limit:
            raise WireError(f"field {name!r} must be a task id of 1 to {bound} characters")
        return value

    return check_task_id


def _client_id(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    def check_client_id(value: Any) -> str:
        if not isinstance(value, str):
            raise _type_error(name, "a str", value)
        if not is_client_id(value):
            raise WireError(f"field {name!r} is not a client id: {value!r:.40}")
        return value

    return check_client_id


def _positive_int(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    limit = math.inf if bound is None else bound

    def check_positive_int(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _type_error(name, "an int", value)
        if value <= 0:
            raise WireError(f"field {name!r} must be positive, got {value}")
        if value > limit:
            raise WireError(f"field {name!r} must be at most {bound}, got {value}")
        return value

    return check_positive_int


def _bool(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    def check_bool(value: Any) -> bool:
        if not isinstance(value, bool):
            raise _type_error(name, "a bool", value)
        return value

    return check_bool


def _map(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    limit = math.inf if bound is None else bound

    def check_map(value: Any) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise _type_error(name, "a map", value)
        if len(value) > limit:
            raise WireError(f"field {name!r} must be a map of at most {bound} entries")
        return value

    return check_map


def _names_map(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    check_map = _map(name, bound, choices)

    def check_names_map(value: Any) -> dict[str, Any]:
        for key in check_map(value):
            if not isinstance(key, str) or not 0 < len(key) <= _MAX_META_NAME:
                raise WireError(
                    f"field {name!r}: metadata name {key!r:.40} is not a string of 1 to "
                    f"{_MAX_META_NAME} characters"
                )
        return value  # type: ignore[no-any-return]

    return check_names_map


def _task_ids(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    limit = bound or 0

    def check_task_ids(value: Any) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise _type_error(name, "a list of task ids", value)
        for item in value:
            if not isinstance(item, str) or not 0 < len(item) <= limit:
                raise WireError(
                    f"field {name!r} must be a list of task ids of 1 to {bound} characters, "
                    f"got an item {item!r:.40}"
                )
        return tuple(value)

    return check_task_ids


def _any(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
    return _identity


def _identity(value: Any) -> Any:
    return value


_CHECKS: dict[str, Callable[[str, int | None, tuple[Any, ...]], Check]] = {
    "str": _str,
    "task id": _task_id,
    "client id": _client_id,
    "positive int": _positive_int,
    "bool": _bool,
    "map": _map,
    "names map": _names_map,
    "list of task ids": _task_ids,
    "any": _any,
}
_SIZED = (str, bytes, list, tuple, dict)


# -- the protocol table in the docs ------------------------------------------------------
def table_rows(
    cls: type, message: str, where: str = "", skip: Collection[str] = ()
) -> list[tuple[str, ...]]:
    """``(message, key, type, bound, presence, meaning)`` per field of ``cls``, nested records after.

    ``skip``: attributes left out (those of a base class, shown once for every message).
    """
    rows: list[tuple[str, ...]] = []
    nested: list[tuple[str, ...]] = []
    keys = {f.attr: f.key for f in fields_of(cls)}
    for f in fields_of(cls):
        if f.attr in skip:
            continue
        rows.append(row(f, message, where, keys))
        if isinstance(f.type, type):
            nested += table_rows(f.type, message, f"{where}{f.key}.")
    return rows + nested


def row(
    f: Field, message: str, where: str = "", keys: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """One field's row of the protocol table (``keys``: attribute to key, for ``when``)."""
    if f.when is not None:
        key = (keys or {}).get(f.when[0], f.when[0])
        presence = f"when `{where}{key}` is {str(f.when[1]).lower()}"
    else:
        presence = "required" if f.required else "optional"
    kind = "map" if isinstance(f.type, type) else f.type
    return (message, f"`{where}{f.key}`", kind, _bound_text(f), presence, f.doc)


def _bound_text(f: Field) -> str:
    if len(f.choices) == 1:
        return f"`{f.choices[0]}`"
    if f.choices:
        return "one of " + ", ".join(f"`{c}`" for c in f.choices)
    if isinstance(f.type, type):
        return f"fields `{f.key}.*` below"
    bound = f.bound
    if f.type == "str":
        return f"at most {bound} characters" if bound else "the codec's `max_str_len`"
    if f.type == "task id":
        return f"1 to {bound} characters"
    if f.type == "client id":
        return "32 lowercase hex digits"
    if f.type == "positive int":
        return f"1 to {bound}" if bound else "at least 1"
    if f.type == "map":
        return f"at most {bound} entries" if bound else "the codec's `Limits`"
    if f.type == "names map":
        return f"at most {bound} entries, names of 1 to {_MAX_META_NAME} characters"
    if f.type == "list of task ids":
        return f"each 1 to {bound} characters"
    return "the codec's `Limits`" if f.type == "any" else ""
