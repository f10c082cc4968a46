"""What travels for one node: the function's identity, its ctx, its gradients.

A remote Function is known by its *name* (``remote_name`` set on the class
itself, else ``"module:QualName"``) and a *fingerprint* of its code, so a
worker running other code for the same name is detected instead of silently
used. A backward task carries the ctx state (saved variables, ``needs_input_grad``,
the user's public ctx attributes) and the incoming gradients; the reply carries
one gradient per forward input. A forward task carries the arguments; its reply, the
outputs and the ctx forward filled. Each of these is a record declared field by field
as the messages are (``_fields``; ``PAYLOADS`` lists them for the protocol table), and
both sides write and read it through that declaration. Variables travel as ``[data,
role]`` (plus ``requires_grad`` for saved variables and arguments); None as nil. A ctx
attribute the Function declares in ``ctx_types`` travels as its record's ``to_data()``
and is rebuilt with the declared class's ``from_data``: the class is the registered
Function's, never a name read from the message.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from asyncgraph import Function, FunctionCtx, Variable, WireError
from asyncgraph.distributed.wire._codec import check_packable
from asyncgraph.distributed.wire._fields import (
    Check,
    Field,
    Shape,
    check_of,
    from_map,
    to_map,
    wire,
)

if TYPE_CHECKING:
    from asyncgraph import Node

__all__ = [
    "BACKWARD_RESULT",
    "PAYLOADS",
    "BackwardTask",
    "CtxState",
    "ForwardResult",
    "ForwardTask",
    "backward_payload",
    "backward_result",
    "ctx_from_state",
    "ctx_state",
    "diagnose_unpackable",
    "fingerprint",
    "forward_payload",
    "read_backward_result",
    "read_forward_result",
    "read_payload",
    "remote_name",
    "restore_ctx",
]

_FINGERPRINTS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()
_CTX_RESERVED = frozenset(dir(FunctionCtx)) | {"needs_input_grad"}


def remote_name(fn: type[Function]) -> str:
    """The name a worker registry knows ``fn`` by: its own ``remote_name`` or ``module:QualName``.

    Example::

        print(remote_name(LLMCall))           # asyncgraph.text.LLMCall
    """
    explicit = fn.__dict__.get("remote_name")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit or len(explicit) > 256:
            raise ValueError(
                f"{fn.__qualname__}.remote_name must be a non-empty str, got {explicit!r}"
            )
        return explicit
    return f"{fn.__module__}:{fn.__qualname__}"


def fingerprint(fn: type[Function]) -> str:
    """sha256 of the source of forward / setup_context / backward (bytecode if no source), 16 hex.

    Example::

        print(fingerprint(LLMCall))           # 16 hex digits; changes when its code does
    """
    cached = _FINGERPRINTS.get(fn)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    for name in ("forward", "setup_context", "backward"):
        method = inspect.getattr_static(fn, name)
        method = getattr(method, "__func__", method)
        if method is getattr(inspect.getattr_static(Function, name), "__func__", None):
            digest.update(b"-")
            continue
        try:
            digest.update(textwrap.dedent(inspect.getsource(method)).encode())
        except (OSError, TypeError):
            code = getattr(method, "__code__", None)
            digest.update(code.co_code if code is not None else repr(method).encode())
    value = _FINGERPRINTS[fn] = digest.hexdigest()[:16]
    return value


# -- variables ------------------------------------------------------------------------
# How Variables travel inside a payload: the field types (``Shape``) the records below
# declare. Each item check returns what the record holds: a Variable, or None.
def _variable(entry: Any, name: str, item: int | str, with_flag: bool = False) -> Variable:
    """The Variable of ``entry``, item ``item`` of field ``name`` (named only in errors: this
    runs for every variable of every task)."""
    if isinstance(entry, list) and len(entry) == 2 + with_flag and isinstance(entry[1], str):
        requires_grad = entry[2] if with_flag else False
        if requires_grad is not True and requires_grad is not False:
            raise WireError(f"field {name!r} item {item!r}: requires_grad must be a bool")
        try:
            return Variable(entry[0], entry[1], requires_grad)
        except TypeError as exc:
            raise WireError(f"field {name!r} item {item!r}: {exc}") from None
    raise WireError(
        f"field {name!r} item {item!r} must be [data, role{', requires_grad' * with_flag}], "
        f"got {type(entry).__name__}"
    )


def _items(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise WireError(f"field {name!r} must be a list, got {type(value).__name__}")
    return value


def _read_gradients(name: str) -> Check:
    def check_gradients(value: Any) -> tuple[Variable | None, ...]:
        grads: list[Variable | None] = []
        for i, e in enumerate(_items(name, value)):
            grads.append(None if e is None else _variable(e, name, i))
        return tuple(grads)

    return check_gradients


def _write_variables(values: Any) -> list[list[Any] | None]:
    # A backward may return raw data for a gradient, a forward for an output: it travels
    # with no role.
    items = values if isinstance(values, tuple) else (values,)
    return [
        None if g is None else [g.data, g.role] if isinstance(g, Variable) else [g, ""]
        for g in items
    ]


def _read_outputs(name: str) -> Check:
    def check_outputs(value: Any) -> tuple[Variable, ...]:
        items = _items(name, value)
        if not items:
            raise WireError(f"field {name!r} must hold at least one output")
        outputs: list[Variable] = []
        for i, e in enumerate(items):
            outputs.append(_variable(e, name, i))
        return tuple(outputs)

    return check_outputs


def _read_saved(name: str) -> Check:
    def check_saved(value: Any) -> tuple[Variable | None, ...] | None:
        if value is None:
            return None
        saved: list[Variable | None] = []
        for i, e in enumerate(_items(name, value)):
            saved.append(None if e is None else _variable(e, name, i, True))
        return tuple(saved)

    return check_saved


def _write_saved(values: tuple[Variable | None, ...] | None) -> list[list[Any] | None] | None:
    if values is None:
        return None
    return [None if v is None else [v.data, v.role, v.requires_grad] for v in values]


def _argument(entry: Any, name: str, item: int | str) -> Any:
    if isinstance(entry, list):
        if len(entry) == 2 and entry[0] == 0:
            return entry[1]
        if len(entry) == 4 and entry[0] == 1:
            return _variable(entry[1:], name, item, True)
    raise WireError(
        f"field {name!r} item {item!r} must be [0, value] or [1, data, role, requires_grad]"
    )


def _argument_entry(value: Any) -> list[Any]:
    if isinstance(value, Variable):
        return [1, value.data, value.role, value.requires_grad]
    return [0, value]


def _read_arguments(name: str) -> Check:
    def check_arguments(value: Any) -> tuple[Any, ...]:
        args: list[Any] = []
        for i, e in enumerate(_items(name, value)):
            args.append(_argument(e, name, i))
        return tuple(args)

    return check_arguments


def _write_arguments(values: tuple[Any, ...]) -> list[list[Any]]:
    return [_argument_entry(v) for v in values]


def _read_named_arguments(name: str) -> Check:
    def check_named_arguments(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise WireError(f"field {name!r} must be a map with str keys")
        return {k: _argument(v, name, k) for k, v in value.items()}

    return check_named_arguments


def _write_named_arguments(values: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: _argument_entry(v) for k, v in values.items()}


_ENTRY = "`[data, role]`"
GRADIENTS = Shape("list of variables", f"each nil or {_ENTRY}", _read_gradients, _write_variables)
OUTPUTS = Shape(
    "list of variables", f"at least one, each {_ENTRY}", _read_outputs, _write_variables
)
SAVED = Shape(
    "list of variables or nil",
    "each nil or `[data, role, requires_grad]`",
    _read_saved,
    _write_saved,
)
ARGUMENTS = Shape(
    "list of arguments",
    "each `[0, value]`, or `[1, data, role, requires_grad]` for a Variable",
    _read_arguments,
    _write_arguments,
)
NAMED_ARGUMENTS = Shape(
    "map of arguments",
    "str keys, each value as in `p.args`",
    _read_named_arguments,
    _write_named_arguments,
)


# -- the payload's records -------------------------------------------------------------
# Declared as the messages are (``_fields``): the encoder, the decoder and the rows of the
# protocol table under ``p`` and ``r`` all follow from these fields. Not frozen, unlike
# the messages: two are built on each side of every task, and a frozen dataclass's
# constructor costs three times as much.
@dataclass(slots=True)
class CtxState:
    """A ctx as it travels: ``ctx_state`` makes one, ``ctx_from_state`` and
    ``restore_ctx`` read one."""

    saved: tuple[Variable | None, ...] | None = field(
        metadata=wire("saved", SAVED, doc="the saved variables; nil once a backward freed them")
    )
    needs: tuple[bool, ...] = field(
        metadata=wire("needs", "list of bools", doc="`ctx.needs_input_grad`")
    )
    attrs: dict[str, Any] = field(
        metadata=wire(
            "attrs",
            "map",
            doc="the attributes forward set on ctx (a record of the Function's "
            "`ctx_types` as its `to_data()`); names with an underscore, or the ctx's "
            "own, are refused",
        )
    )


@dataclass(slots=True)
class BackwardTask:
    """What a backward task carries (``p``, when ``op`` is ``backward``)."""

    ctx: CtxState = field(metadata=wire("ctx", CtxState, doc="the node's ctx"))
    grads: tuple[Variable | None, ...] = field(
        metadata=wire("g", GRADIENTS, doc="one gradient per forward output")
    )


@dataclass(slots=True)
class ForwardTask:
    """What a forward task carries (``p``, when ``op`` is ``forward``)."""

    args: tuple[Any, ...] = field(metadata=wire("args", ARGUMENTS, doc="the positional arguments"))
    kwargs: dict[str, Any] = field(
        metadata=wire("kw", NAMED_ARGUMENTS, doc="the keyword arguments")
    )
    needs: tuple[bool, ...] = field(
        metadata=wire(
            "needs",
            "list of bools",
            doc="per input, whether the client's node will ask for its gradient (all "
            "false when the client does not record the node)",
        )
    )


@dataclass(slots=True)
class ForwardResult:
    """What a forward's reply carries (``r``): its outputs and its ctx."""

    # Variables when read; on the worker, what forward returned (raw values included).
    outputs: tuple[Any, ...] = field(
        metadata=wire("out", OUTPUTS, doc="the outputs forward returned")
    )
    is_tuple: bool = field(metadata=wire("tuple", "bool", doc="whether forward returned a tuple"))
    ctx: CtxState = field(metadata=wire("ctx", CtxState, doc="the ctx forward filled"))
    non_differentiable: tuple[int, ...] = field(
        metadata=wire(
            "nd", "list of indices", doc="the outputs marked non-differentiable, by index"
        )
    )
    raw: tuple[int, ...] | None = field(
        default=None,
        metadata=wire(
            "raw",
            "list of indices",
            required=False,
            doc="the outputs forward returned as raw values, not Variables, by index: the "
            "client records them raw too (no zero gradient is made for them)",
        ),
    )


# The reply to a backward (``r``): a list, not a map.
BACKWARD_RESULT = Field(
    "r", GRADIENTS, doc='one gradient per forward input (a raw value returned, with role `""`)'
)
_check_backward_result = check_of(BACKWARD_RESULT)
# What the protocol table shows under ``p`` and ``r``: (message, key prefix, record).
PAYLOADS: tuple[tuple[str, str, type], ...] = (
    ("task: backward", "p.", BackwardTask),
    ("task: forward", "p.", ForwardTask),
    ("reply: forward", "r.", ForwardResult),
)

R = TypeVar("R")


def read_payload(cls: type[R], m: Any, where: str) -> R:
    """The ``cls`` record that the map ``m`` (field ``where`` of its message) holds;
    ``WireError`` names the first field that is missing or wrong."""
    if not isinstance(m, dict):
        raise WireError(f"field {where!r} must be a map, got {type(m).__name__}")
    return from_map(cls, m, where + ".")


# -- ctx ------------------------------------------------------------------------------
def _ctx_attrs(ctx: FunctionCtx, fn: type[Function]) -> dict[str, Any]:
    """The public ctx attributes, declared records (``fn.ctx_types``) as their data.

    Raises ``TypeError`` when a declared attribute holds something else.
    """
    typed = fn.ctx_types
    attrs: dict[str, Any] = {}
    for key, value in vars(ctx).items():
        if key[0] == "_" or key == "needs_input_grad":
            continue
        kind = typed.get(key)
        if kind is not None:
            if not isinstance(value, kind):
                raise TypeError(
                    f"ctx.{key} must be a {kind.__name__} ({fn.__name__}.ctx_types declares "
                    f"it), got {type(value).__name__} ({value!r:.60})"
                )
            value = value.to_data()
        attrs[key] = value
    return attrs


def ctx_state(ctx: FunctionCtx, fn: type[Function]) -> CtxState:
    """The ctx as it travels (call ``diagnose_unpackable`` if packing it then fails).

    Raises ``GraphError`` when a saved variable was changed in place since it was saved
    (``ctx.mark_dirty``), as reading ``ctx.saved_variables`` in-process does."""
    saved = None if ctx.raw_saved is None else ctx.saved_variables
    return CtxState(saved, ctx.needs_input_grad, _ctx_attrs(ctx, fn))


def ctx_from_state(state: CtxState, fn: type[Function]) -> FunctionCtx:
    """A ctx of ``fn`` rebuilt from ``state`` (on the worker); ``WireError`` if an
    attribute is refused."""
    ctx = FunctionCtx(function_name=fn.__name__)
    ctx.needs_input_grad = state.needs
    restore_ctx(ctx, state, fn)
    return ctx


def restore_ctx(ctx: FunctionCtx, state: CtxState, fn: type[Function]) -> None:
    """Set ``ctx``'s saved variables and attributes from ``state``, a declared record
    (``fn.ctx_types``) rebuilt with its class; ``WireError`` if an attribute is refused."""
    ctx.raw_saved = state.saved
    typed = fn.ctx_types
    for key, value in state.attrs.items():
        if key not in _CTX_NAMES_SEEN:
            _check_ctx_name(key)
        kind = typed.get(key) if typed else None
        if kind is not None:
            try:
                value = kind.from_data(value)
            except (TypeError, ValueError) as exc:
                raise WireError(
                    f"ctx attribute {key!r} is not a valid {kind.__name__}: {exc}"
                ) from None
        setattr(ctx, key, value)


def _check_ctx_name(key: Any) -> None:
    """``WireError`` unless ``key`` may name a ctx attribute sent from elsewhere."""
    if (
        not isinstance(key, str)
        or not key.isidentifier()
        or key.startswith("_")
        or key in _CTX_RESERVED
    ):
        raise WireError(f"ctx attribute name {key!r:.60} is not allowed")
    if len(_CTX_NAMES_SEEN) < 4096:
        _CTX_NAMES_SEEN.add(key)


# The names checked and allowed so far: the few that Functions use, each checked once
# rather than for every task (bounded, whatever the messages say).
_CTX_NAMES_SEEN: set[str] = set()


def diagnose_unpackable(
    fn: type[Function], ctx: FunctionCtx | None, values: dict[str, Any]
) -> TypeError:
    """A TypeError naming the ctx attribute (or value) of ``fn`` that cannot be sent."""
    fn_name = fn.__name__
    if ctx is not None:
        try:
            attrs = _ctx_attrs(ctx, fn)
        except TypeError as exc:
            return TypeError(f"{fn_name}: {exc}")
        for key, value in attrs.items():
            try:
                check_packable(value, f"ctx.{key}")
            except TypeError as exc:
                return TypeError(
                    f"{fn_name}: ctx attribute {key!r} cannot be sent to a worker ({exc}); "
                    f"store only msgpack-serializable values on ctx (str, int, float, bool, "
                    f"None, bytes, lists, tuples, dicts with str or int keys, numpy arrays), or set "
                    f"{fn_name}.dispatch = 'local'"
                )
        for i, var in enumerate(ctx.raw_saved or ()):
            if var is not None:
                try:
                    check_packable(var.data, f"saved variable {i} (role {var.role!r})")
                except TypeError as exc:
                    return TypeError(f"{fn_name}: {exc}; it cannot be sent to a worker")
    for what, value in values.items():
        try:
            check_packable(value, what)
        except TypeError as exc:
            return TypeError(f"{fn_name}: {exc}; it cannot be sent to a worker")
    return TypeError(f"{fn_name}: the task cannot be serialized to msgpack")


# -- encoding each payload -----------------------------------------------------------
def backward_payload(node: Node, grad_outputs: tuple[Variable | None, ...]) -> dict[str, Any]:
    """``p`` of a backward task."""
    return to_map(BackwardTask(ctx_state(node.ctx, node.function), grad_outputs))


def forward_payload(
    args: tuple[Any, ...], kwargs: dict[str, Any], needs: tuple[bool, ...]
) -> dict[str, Any]:
    """``p`` of a forward task."""
    return to_map(ForwardTask(args, kwargs, needs))


def backward_result(result: Any) -> list[list[Any] | None]:
    """``r`` of a backward's reply: what the backward returned, one gradient per input."""
    return _write_variables(result)


def read_backward_result(result: Any) -> tuple[Variable | None, ...]:
    """The gradients of a backward's reply (``r``)."""
    return _check_backward_result(result)  # type: ignore[no-any-return]


def read_forward_result(result: Any) -> ForwardResult:
    """The record of a forward's reply (``r``), its output indices checked."""
    record = read_payload(ForwardResult, result, "r")
    count = len(record.outputs)
    for key, indices in (("nd", record.non_differentiable), ("raw", record.raw or ())):
        if any(i >= count for i in indices):
            raise WireError(f"field 'r.{key}' must list indices of the {count} output(s)")
    return record
