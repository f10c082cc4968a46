"""What travels for one node: the function's identity, its ctx, its gradients.

A remote Function is known by its *name* (``remote_name`` set on the class
itself, else ``"module:QualName"``) and a *fingerprint* of its code, so a
worker running other code for the same name is detected instead of silently
used. A backward task carries the ctx state (saved variables, ``needs_input_grad``,
the user's public ctx attributes) and the incoming gradients; the reply carries
one gradient per forward input. Variables travel as ``[data, role]`` (plus
``requires_grad`` for saved variables and arguments); None as nil. A ctx attribute
the Function declares in ``ctx_types`` travels as its record's ``to_data()`` and is
rebuilt with the declared class's ``from_data``: the class is the registered
Function's, never a name read from the message.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
import weakref
from typing import TYPE_CHECKING, Any

from asyncgraph import Function, FunctionCtx, Variable, WireError
from asyncgraph.distributed.wire._codec import check_packable

if TYPE_CHECKING:
    from asyncgraph import Node

__all__ = [
    "backward_payload",
    "ctx_from_state",
    "ctx_state",
    "diagnose_unpackable",
    "fingerprint",
    "forward_payload",
    "grads_from_entries",
    "remote_name",
    "result_entries",
    "var_entry",
    "var_from_entry",
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


# -- variables ------------------------------------------------------------------
def var_entry(var: Variable | None) -> list[Any] | None:
    return None if var is None else [var.data, var.role]


def var_from_entry(entry: Any, what: str, *, with_flag: bool = False) -> Variable | None:
    if entry is None:
        return None
    size = 3 if with_flag else 2
    if not (isinstance(entry, list) and len(entry) == size and isinstance(entry[1], str)):
        raise WireError(
            f"{what} must be nil or [data, role{', requires_grad' if with_flag else ''}]"
        )
    try:
        var = Variable(entry[0], role=entry[1])
    except TypeError as exc:
        raise WireError(f"{what}: {exc}") from None
    if with_flag:
        if not isinstance(entry[2], bool):
            raise WireError(f"{what}: requires_grad must be a bool")
        var._requires_grad = entry[2]
    return var


def _saved_entry(var: Variable | None) -> list[Any] | None:
    return None if var is None else [var.data, var.role, var._requires_grad]


# -- ctx ----------------------------------------------------------------------------
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


def ctx_state(ctx: FunctionCtx, fn: type[Function]) -> dict[str, Any]:
    """The ctx as plain data (call ``diagnose_unpackable`` if packing it then fails).

    Raises ``GraphError`` when a saved variable was changed in place since it was saved
    (``ctx.mark_dirty``), as reading ``ctx.saved_variables`` in-process does."""
    saved = None if ctx._saved is None else ctx.saved_variables
    return {
        "saved": None if saved is None else [_saved_entry(v) for v in saved],
        "needs": list(ctx.needs_input_grad),
        "attrs": _ctx_attrs(ctx, fn),
    }


def ctx_from_state(state: Any, fn: type[Function]) -> FunctionCtx:
    """Rebuild a ctx on the worker; ``WireError`` if the state is malformed."""
    if not isinstance(state, dict):
        raise WireError("ctx state must be a map")
    ctx = FunctionCtx()
    ctx._function_name = fn.__name__
    needs = state.get("needs")
    if not isinstance(needs, list) or not all(isinstance(n, bool) for n in needs):
        raise WireError("ctx 'needs' must be a list of bools")
    ctx.needs_input_grad = tuple(needs)
    saved = state.get("saved")
    if saved is None:
        ctx._saved = None
    elif isinstance(saved, list):
        ctx._saved = tuple(
            var_from_entry(e, f"saved variable {i}", with_flag=True) for i, e in enumerate(saved)
        )
    else:
        raise WireError("ctx 'saved' must be a list or nil")
    attrs = state.get("attrs")
    if not isinstance(attrs, dict):
        raise WireError("ctx 'attrs' must be a map")
    for key, value in attrs.items():
        if (
            not isinstance(key, str)
            or not key.isidentifier()
            or key.startswith("_")
            or key in _CTX_RESERVED
        ):
            raise WireError(f"ctx attribute name {key!r:.60} is not allowed")
        kind = fn.ctx_types.get(key)
        if kind is not None:
            try:
                value = kind.from_data(value)
            except (TypeError, ValueError) as exc:
                raise WireError(
                    f"ctx attribute {key!r} is not a valid {kind.__name__}: {exc}"
                ) from None
        setattr(ctx, key, value)
    return ctx


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
        for i, var in enumerate(ctx._saved or ()):
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


# -- backward ---------------------------------------------------------------------------
def backward_payload(node: Node, grad_outputs: tuple[Variable | None, ...]) -> dict[str, Any]:
    return {"ctx": ctx_state(node.ctx, node.function), "g": [var_entry(g) for g in grad_outputs]}


def grads_from_entries(entries: Any, what: str) -> tuple[Variable | None, ...]:
    if not isinstance(entries, list):
        raise WireError(f"{what} must be a list")
    return tuple(var_from_entry(e, f"{what}[{i}]") for i, e in enumerate(entries))


def result_entries(result: Any) -> list[list[Any] | None]:
    """A backward's return value as gradient entries (one per forward input)."""
    items = result if isinstance(result, tuple) else (result,)
    return [
        None if g is None else [g.data, g.role] if isinstance(g, Variable) else [g, ""]
        for g in items
    ]


# -- forward -------------------------------------------------------------------------
def forward_payload(
    args: tuple[Any, ...], kwargs: dict[str, Any], needs: tuple[bool, ...]
) -> dict[str, Any]:
    def arg(value: Any) -> list[Any]:
        if isinstance(value, Variable):
            return [1, value.data, value.role, value._requires_grad]
        return [0, value]

    return {
        "args": [arg(a) for a in args],
        "kw": {k: arg(v) for k, v in kwargs.items()},
        "needs": list(needs),
    }


def forward_args(
    payload: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[bool, ...]]:
    def arg(entry: Any, what: str) -> Any:
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == 0:
            return entry[1]
        if isinstance(entry, list) and len(entry) == 4 and entry[0] == 1:
            return var_from_entry(entry[1:], what, with_flag=True)
        raise WireError(f"{what} must be [0, value] or [1, data, role, requires_grad]")

    args, kw, needs = payload.get("args"), payload.get("kw"), payload.get("needs")
    if not isinstance(args, list) or not isinstance(kw, dict):
        raise WireError("forward payload needs 'args' (list) and 'kw' (map)")
    if not all(isinstance(k, str) for k in kw):
        raise WireError("forward payload 'kw' must have str keys")
    if not isinstance(needs, list) or not all(isinstance(n, bool) for n in needs):
        raise WireError("forward payload 'needs' must be a list of bools")
    return (
        tuple(arg(a, f"argument {i}") for i, a in enumerate(args)),
        {k: arg(v, f"argument {k!r}") for k, v in kw.items()},
        tuple(needs),
    )
