"""A Function's remote identity, and how its ctx, arguments and gradients travel."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest

from asyncgraph import Function, FunctionCtx, GraphError, Node, Parameter, Variable, WireError
from asyncgraph.distributed.wire._codec import pack, unpack
from asyncgraph.distributed.wire._fields import from_map, table_rows, to_map, wire
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS
from asyncgraph.distributed.wire._payload import (
    BackwardTask,
    CtxState,
    ForwardResult,
    ForwardTask,
    backward_payload,
    backward_result,
    ctx_from_state,
    ctx_state,
    diagnose_unpackable,
    fingerprint,
    forward_payload,
    read_backward_result,
    read_forward_result,
    read_payload,
    remote_name,
)


class Named(Function):
    dispatch = "remote"
    remote_name = "app.named"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return x

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


class Child(Named):
    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return Variable(g.data)


def test_remote_name_is_explicit_or_module_qualname() -> None:
    assert remote_name(Named) == "app.named"
    assert remote_name(Child) == f"{__name__}:Child"  # not inherited


def test_fingerprint_follows_the_code() -> None:
    assert len(fingerprint(Named)) == 16
    assert fingerprint(Named) != fingerprint(Child)
    assert fingerprint(Named) == fingerprint(Named)


def test_ctx_state_round_trip() -> None:
    ctx = FunctionCtx()
    ctx.needs_input_grad = (True, False)
    ctx.save_for_backward(Variable("a", role="r"), None)
    ctx.alpha = 0.5
    ctx.names = ("x", "y")
    back = ctx_from_state(ctx_state(ctx, Named), Named)
    (a, none) = back.saved_variables
    assert (a.data, a.role, none) == ("a", "r", None)
    assert back.alpha == 0.5 and back.names == ("x", "y")
    assert back.needs_input_grad == (True, False)


@pytest.mark.parametrize(
    "name", ["_saved", "save_for_backward", "needs_input_grad", "1x", "__class__"]
)
def test_reserved_ctx_attribute_names_are_refused(name: str) -> None:
    state = from_map(CtxState, {"saved": [], "needs": [], "attrs": {name: 1}})
    with pytest.raises(WireError, match="not allowed"):
        ctx_from_state(state, Named)


def test_unpackable_attribute_is_named() -> None:
    ctx = FunctionCtx()
    ctx.fine = 1
    ctx.handle = open  # a builtin function: not data
    error = diagnose_unpackable(Named, ctx, {})
    assert "Named" in str(error) and "'handle'" in str(error)


@dataclass(frozen=True)
class Scale:
    """A typed ctx record: plain data on the wire, checked when rebuilt."""

    factor: float

    def to_data(self) -> dict[str, Any]:
        return {"factor": self.factor}

    @classmethod
    def from_data(cls, data: Any) -> Scale:
        if not (isinstance(data, dict) and set(data) == {"factor"}):
            raise TypeError(f"Scale data must be {{'factor': float}}, got {data!r}")
        return cls(float(data["factor"]))


class Scaled(Named):
    ctx_types = MappingProxyType({"scale": Scale})


def test_a_declared_ctx_record_travels_as_data_and_comes_back_typed() -> None:
    ctx = FunctionCtx()
    ctx.needs_input_grad = (True,)
    ctx.scale = Scale(2.0)
    state = ctx_state(ctx, Scaled)
    assert state.attrs == {"scale": {"factor": 2.0}}
    back = ctx_from_state(state, Scaled)
    assert back.scale == Scale(2.0)


def test_a_declared_ctx_record_that_does_not_decode_is_a_wire_error() -> None:
    state = from_map(
        CtxState, {"saved": [], "needs": [], "attrs": {"scale": {"factor": 2.0, "extra": 1}}}
    )
    with pytest.raises(WireError, match="ctx attribute 'scale' is not a valid Scale"):
        ctx_from_state(state, Scaled)
    # Undeclared, the same data stays plain data: nothing is built from the message.
    assert ctx_from_state(state, Named).scale == {"factor": 2.0, "extra": 1}


def test_a_declared_ctx_attribute_holding_something_else_is_named() -> None:
    ctx = FunctionCtx()
    ctx.scale = 2.0
    with pytest.raises(TypeError, match=r"ctx.scale must be a Scale \(Scaled.ctx_types"):
        ctx_state(ctx, Scaled)
    assert "ctx.scale must be a Scale" in str(diagnose_unpackable(Scaled, ctx, {}))


def test_ctx_types_must_name_record_classes() -> None:
    with pytest.raises(TypeError, match="ctx_types maps ctx attribute names to classes"):

        class Bad(Named):
            ctx_types = MappingProxyType({"scale": dict})


# -- the payload's records: declared once, like the messages --------------------------
class Saving(Function):
    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, scale: float = 2.0) -> Variable:
        ctx.save_for_backward(x, None)
        ctx.scale = scale
        return Variable(x.data * scale, role="scaled")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        return Variable(g.data * ctx.scale), None


def saving_node() -> Node:
    node = Saving.apply(Parameter(3.0, role="x"), scale=2.0).grad_fn
    assert node is not None
    return node


def travelled(m: Any) -> Any:
    return unpack(pack(m), DEFAULT_LIMITS)


def test_the_payloads_keep_the_form_that_protocol_2_readers_know() -> None:
    # Byte for byte the maps the hand-written encoders wrote: a client or worker of the
    # same protocol version, built before the payload was declared, reads them.
    ctx_map = {"saved": [[3.0, "x", True], None], "needs": [True, False], "attrs": {"scale": 2.0}}
    node = saving_node()
    assert backward_payload(node, (Variable(1.0, role="g"),)) == {
        "ctx": ctx_map,
        "g": [[1.0, "g"]],
    }
    x = Parameter(3.0, role="x")
    assert forward_payload((x,), {"scale": 2.0}, (True, False)) == {
        "args": [[1, 3.0, "x", True]],
        "kw": {"scale": [0, 2.0]},
        "needs": [True, False],
    }
    outputs = (Variable(6.0, role="scaled"), 7)  # the second returned raw
    result = ForwardResult(outputs, True, ctx_state(node.ctx, Saving), (1,), (1,))
    assert to_map(result) == {
        "out": [[6.0, "scaled"], [7, ""]],
        "tuple": True,
        "ctx": ctx_map,
        "nd": [1],
        "raw": [1],
    }
    # No raw output: "raw" is left out, which readers take for none (as from older workers).
    assert "raw" not in to_map(ForwardResult(outputs[:1], False, result.ctx, ()))
    assert backward_result((Variable(1.0, role="r"), None, 5)) == [[1.0, "r"], None, [5, ""]]


def test_each_payload_comes_back_as_it_was_sent() -> None:
    node = saving_node()
    task = read_payload(
        BackwardTask, travelled(backward_payload(node, (Variable(1.0, role="g"),))), "p"
    )
    ctx = ctx_from_state(task.ctx, Saving)
    (x, none) = ctx.saved_variables
    assert (x.data, x.role, x.requires_grad, none) == (3.0, "x", True, None)
    assert (ctx.scale, ctx.needs_input_grad, ctx.function_name) == (2.0, (True, False), "Saving")
    assert [(g.data, g.role) for g in task.grads if g is not None] == [(1.0, "g")]

    x_in = Parameter(3.0, role="x")
    forward = read_payload(
        ForwardTask, travelled(forward_payload((x_in, "s"), {"scale": 2.0}, (True,))), "p"
    )
    (x_back, s) = forward.args
    assert (x_back.data, x_back.role, x_back.requires_grad, s) == (3.0, "x", True, "s")
    assert forward.kwargs == {"scale": 2.0} and forward.needs == (True,)

    sent = ForwardResult((Variable(6.0, role="y"), 7), True, task.ctx, (1,), (1,))
    back = read_forward_result(travelled(to_map(sent)))
    assert [(v.data, v.role) for v in back.outputs] == [(6.0, "y"), (7, "")]
    assert (back.is_tuple, back.non_differentiable, back.raw) == (True, (1,), (1,))
    assert to_map(back.ctx) == to_map(task.ctx)

    grads = read_backward_result(travelled(backward_result((Variable(1.0, role="r"), None))))
    assert grads[1] is None and grads[0] is not None and grads[0].role == "r"


@dataclass(slots=True)
class TracedBackward(BackwardTask):
    """A backward task with one field more, declared here and nowhere else."""

    trace: str | None = field(
        default=None,
        metadata=wire("tr", "str", 64, required=False, doc="the sender's trace id"),
    )


def test_a_field_declared_once_on_a_payload_record_is_written_read_and_documented() -> None:
    base = read_payload(BackwardTask, backward_payload(saving_node(), (Variable(1.0),)), "p")
    traced = TracedBackward(base.ctx, base.grads, trace="t-1")
    m = travelled(to_map(traced))
    assert m["tr"] == "t-1"
    back = read_payload(TracedBackward, m, "p")
    assert back.trace == "t-1" and to_map(back) == to_map(traced)
    with pytest.raises(WireError, match=r"field 'p\.tr' is longer than 64 characters"):
        read_payload(TracedBackward, {**m, "tr": "x" * 65}, "p")
    # The protocol's rule for a field added later: a reader that does not know it ignores
    # it, and a reader that knows it finds it absent from an older sender's map.
    assert to_map(read_payload(BackwardTask, m, "p")) == to_map(base)
    assert read_payload(TracedBackward, to_map(base), "p").trace is None
    row = (
        "task: backward",
        "`p.tr`",
        "str",
        "at most 64 characters",
        "optional",
        "the sender's trace id",
    )
    assert row in table_rows(TracedBackward, "task: backward", "p.")


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"ctx": [], "g": []}, "field 'p.ctx' must be a map, got list"),
        ({"ctx": {"saved": [], "needs": [], "attrs": {}}}, "field 'p.g' is missing"),
        (
            {"ctx": {"saved": [], "needs": [1], "attrs": {}}, "g": []},
            "field 'p.ctx.needs' must be a list of bools",
        ),
        (
            {"ctx": {"saved": [[1.0, "r"]], "needs": [], "attrs": {}}, "g": []},
            r"field 'p.ctx.saved' item 0 must be \[data, role, requires_grad\]",
        ),
        (
            {"ctx": {"saved": [[1.0, "r", 1]], "needs": [], "attrs": {}}, "g": []},
            "item 0: requires_grad must be a bool",
        ),
        (
            {"ctx": {"saved": None, "needs": [], "attrs": 3}, "g": []},
            "field 'p.ctx.attrs' must be a map",
        ),
        (
            {"ctx": {"saved": None, "needs": [], "attrs": {}}, "g": [[1.0, 2]]},
            r"field 'p.g' item 0 must be \[data, role\]",
        ),
    ],
)
def test_a_malformed_backward_payload_names_its_field(payload: Any, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        read_payload(BackwardTask, payload, "p")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"out": []}, "field 'r.out' must hold at least one output"),
        ({"out": [None]}, r"field 'r.out' item 0 must be \[data, role\]"),
        ({"tuple": 1}, "field 'r.tuple' must be a bool"),
        ({"nd": [1]}, r"field 'r.nd' must list indices of the 1 output\(s\)"),
        ({"raw": [-1]}, "field 'r.raw' must be a list of ints from 0"),
    ],
)
def test_a_malformed_forward_result_names_its_field(change: dict[str, Any], reason: str) -> None:
    good = {"out": [[1.0, ""]], "tuple": False, "ctx": {"saved": [], "needs": [], "attrs": {}}}
    assert read_forward_result({**good, "nd": []}).raw is None
    with pytest.raises(WireError, match=reason):
        read_forward_result({**good, "nd": [], **change})


def test_a_freed_ctx_travels_freed() -> None:
    # nil, not an empty list: its backward then says it ran a second time, as in-process.
    ctx = FunctionCtx()
    ctx.save_for_backward(Variable(1.0))
    ctx.raw_saved = None
    back = ctx_from_state(
        read_payload(CtxState, travelled(to_map(ctx_state(ctx, Named))), "c"), Named
    )
    assert back.raw_saved is None
    with pytest.raises(GraphError, match="backward through the graph a second time"):
        _ = back.saved_variables
    nothing_saved = ctx_from_state(ctx_state(FunctionCtx(), Named), Named)
    assert nothing_saved.saved_variables == ()
