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
- ``list of bools``: each item True or False (a tuple in the record);
- ``list of indices``: each item an int from 0 (a tuple in the record);
- ``any``: whatever the codec accepts;
- a record class: a map of that record's own fields (a reply's ``err``);
- a ``Shape``: a type declared beside its records, with its own check and conversion
  (the payload's Variables, in ``_payload``).

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
    "Shape",
    "check",
    "check_of",
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
    "list of bools",
    "list of indices",
    "any",
]
_WIRE = "asyncgraph.wire"  # the metadata key a dataclass field's Field is stored under
_MAX_META_NAME = 32
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """A field type declared beside the records that use it (not one of ``FieldType``).

    ``name`` and ``bound`` are its type and bound in the protocol table; ``read(name)``
    makes the check of one value of the field ``name`` (raising ``WireError`` naming
    it; it returns the value as the record holds it); ``write`` turns the record's value
    into what travels (None: as it is).
    """

    name: str
    bound: str
    read: Callable[[str], Check]
    write: Callable[[Any], Any] | None = None


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
    type: FieldType | type | Shape
    bound: int | None = None
    required: bool = True
    doc: str = ""
    choices: tuple[Any, ...] = ()
    when: tuple[str, Any] | None = None
    attr: str = ""
    init: bool = True


def wire(
    key: str,
    type: FieldType | type | Shape,
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
    later attribute or without a default (the value when it is absent), or a key used
    twice.
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
        if declared.when is not None and dc_field.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{dc_field.name}: a when= field needs a default")
        if declared.key in {f.key for f in table}:
            raise TypeError(f"{cls.__name__}.{dc_field.name}: key {declared.key!r} is taken")
        table.append(dataclasses.replace(declared, attr=dc_field.name, init=dc_field.init))
    return tuple(table)


def to_map(record: Any, m: dict[str, Any] | None = None) -> dict[str, Any]:
    """The msgpack map of ``record``: its declared fields in order, after those of ``m``."""
    record_type: type = type(record)  # (functools.cache wants a plain type, for mypy)
    return _writer(record_type)(record, {} if m is None else m)


def from_map(cls: type[R], m: Mapping[Any, Any], where: str = "") -> R:
    """The ``cls`` record that ``m`` holds; ``WireError`` names the first bad field."""
    record_type: type = cls  # (functools.cache wants a plain type, for mypy)
    return _reader(record_type, where)(m)  # type: ignore[no-any-return]


def check(f: Field, value: Any, where: str = "") -> Any:
    """``value`` as field ``f`` of the record (``where`` prefixes its key in errors)."""
    return _checker(f, where)(value)


def check_of(f: Field, where: str = "") -> Check:
    """The check ``check`` runs, made once: for a field read on every task."""
    return _checker(f, where)


# NOTE [Compiled records]
# Every task is written and read once on each side, its payload inside it: the writer and
# the reader of a record class are compiled once from its declaration into a function of
# plain statements, one or two per field (as ``dataclasses`` compiles ``__init__``), which
# costs what a hand-written encoder costs, not a loop over the table per message. The
# source holds only the declaration's keys (as literals) and attribute names; every value
# (a check, a conversion, a ``when`` value) is passed in by name.
@functools.cache
def _writer(cls: type) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    env: dict[str, Any] = {"SIZED": _SIZED}
    lines = ["def write(record, m):"]
    for i, f in enumerate(fields_of(cls)):
        indent = "    "
        if f.when is not None:
            env[f"when{i}"] = f.when[1]
            lines.append(f"{indent}if record.{f.when[0]} == when{i}:")
            indent += "    "
        value = f"record.{f.attr}"
        if not f.required:
            lines.append(f"{indent}v = {value}")
            lines.append(f"{indent}if not (v is None or (not v and isinstance(v, SIZED))):")
            value, indent = "v", indent + "    "
        if isinstance(f.type, type):  # a record: its own writer, into a map of its own
            env[f"write{i}"] = _writer(f.type)
            value = f"write{i}({value}, {{}})"
        elif (convert := _write_conversion(f)) is not None:
            env[f"convert{i}"] = convert
            value = f"convert{i}({value})"
        lines.append(f"{indent}m[{f.key!r}] = {value}")
    lines.append("    return m")
    return _compiled(lines, env, "write")  # type: ignore[no-any-return]


def _write_conversion(f: Field) -> Callable[[Any], Any] | None:
    if isinstance(f.type, Shape):
        return f.type.write
    # a tuple would travel as the codec's tuple extension, not as an array
    return list if f.type in _TUPLES else None


@functools.cache
def _reader(cls: type, where: str) -> Callable[[Mapping[Any, Any]], Any]:
    env: dict[str, Any] = {"cls": cls, "ABSENT": _ABSENT, "WireError": WireError}
    lines = ["def read(m):"]
    fields = fields_of(cls)
    local = {f.attr: f"v{i}" for i, f in enumerate(fields)}  # each field's value
    declared = {f.name: f for f in dataclasses.fields(cls)}
    for i, f in enumerate(fields):
        v, indent = local[f.attr], "    "
        if f.when is not None:
            env[f"default{i}"] = declared[f.attr].default
            env[f"when{i}"] = f.when[1]
            lines.append(f"{indent}{v} = default{i}")
            lines.append(f"{indent}if {local[f.when[0]]} == when{i}:")
            indent += "    "
        env[f"check{i}"] = _checker(f, where)
        lines.append(f"{indent}{v} = m.get({f.key!r}, ABSENT)")
        lines.append(f"{indent}if {v} is not ABSENT:")
        lines.append(f"{indent}    {v} = check{i}({v})")
        lines.append(f"{indent}else:")
        if f.required:
            env[f"missing{i}"] = f"field {where + f.key!r} is missing"
            lines.append(f"{indent}    raise WireError(missing{i})")
        else:
            lines.append(f"{indent}    {v} = None")
    passed = [f for f in fields if f.init]  # in order; the keyword-only ones by name, last
    arguments = [local[f.attr] for f in passed if not declared[f.attr].kw_only]
    arguments += [f"{f.attr}={local[f.attr]}" for f in passed if declared[f.attr].kw_only]
    lines.append(f"    return cls({', '.join(arguments)})")
    return _compiled(lines, env, "read")  # type: ignore[no-any-return]


def _compiled(lines: list[str], env: dict[str, Any], name: str) -> Any:
    exec("\n".join(lines), env)  # see NOTE [Compiled records]
    return env[name]


_ABSENT = object()  # a key not in the map (None is a value)


@functools.cache
def _checker(f: Field, where: str) -> Check:
    name = where + f.key
    record = f.type
    if isinstance(record, Shape):
        return record.read(name)
    if isinstance(record, type):
        read = _reader(record, f"{name}.")

        def check_record(value: Any) -> Any:
            if not isinstance(value, dict):
                raise _type_error(name, "a map", value)
            return read(value)

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


def _list_of(
    items: str, ok: Callable[[Any, int], bool], bounded: str = ""
) -> Callable[[str, int | None, tuple[Any, ...]], Check]:
    """The factory of a ``list of ...`` check: a list whose every item is ``ok(item,
    bound)``, a tuple in the record. ``bounded``: what the error adds of the bound."""

    def factory(name: str, bound: int | None, choices: tuple[Any, ...]) -> Check:
        limit = bound or 0
        what = f"a list of {items}"

        def check_list(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list):
                raise _type_error(name, what, value)
            for item in value:
                if not ok(item, limit):
                    raise WireError(
                        f"field {name!r} must be {what}{bounded.format(bound=bound)}, "
                        f"got an item {item!r:.40}"
                    )
            return tuple(value)

        return check_list

    return factory


_task_ids = _list_of(
    "task ids",
    lambda item, limit: isinstance(item, str) and 0 < len(item) <= limit,
    " of 1 to {bound} characters",
)
_bools = _list_of("bools", lambda item, limit: item is True or item is False)
_indices = _list_of("ints from 0", lambda item, limit: type(item) is int and item >= 0)


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
    "list of bools": _bools,
    "list of indices": _indices,
    "any": _any,
}
_TUPLES = ("list of task ids", "list of bools", "list of indices")  # lists on the wire
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
    kind = (
        "map" if isinstance(f.type, type) else f.type.name if isinstance(f.type, Shape) else f.type
    )
    return (message, f"`{where}{f.key}`", kind, _bound_text(f, where), presence, f.doc)


def _bound_text(f: Field, where: str) -> str:
    if len(f.choices) == 1:
        return f"`{f.choices[0]}`"
    if f.choices:
        return "one of " + ", ".join(f"`{c}`" for c in f.choices)
    if isinstance(f.type, type):
        return f"fields `{where}{f.key}.*` below"
    if isinstance(f.type, Shape):
        return f.type.bound
    if f.bound and f.type in _BOUNDED:
        return _BOUNDED[f.type].format(bound=f.bound)
    return _UNBOUNDED.get(f.type, "")


# What the protocol table says of a type's bound: when the field has one, and when not.
_BOUNDED = {
    "str": "at most {bound} characters",
    "task id": "1 to {bound} characters",
    "positive int": "1 to {bound}",
    "map": "at most {bound} entries",
    "names map": f"at most {{bound}} entries, names of 1 to {_MAX_META_NAME} characters",
    "list of task ids": "each 1 to {bound} characters",
}
_UNBOUNDED = {
    "str": "the codec's `max_str_len`",
    "client id": "32 lowercase hex digits",
    "positive int": "at least 1",
    "map": "the codec's `Limits`",
    "list of indices": "each from 0",
    "any": "the codec's `Limits`",
}
