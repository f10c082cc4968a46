"""A Function's remote identity and how its ctx travels."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest

from asyncgraph import Function, FunctionCtx, Variable, WireError
from asyncgraph.distributed.wire._payload import (
    ctx_from_state,
    ctx_state,
    diagnose_unpackable,
    fingerprint,
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
    state = {"saved": [], "needs": [], "attrs": {name: 1}}
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
    assert state["attrs"] == {"scale": {"factor": 2.0}}
    back = ctx_from_state(state, Scaled)
    assert back.scale == Scale(2.0)


def test_a_declared_ctx_record_that_does_not_decode_is_a_wire_error() -> None:
    state = {"saved": [], "needs": [], "attrs": {"scale": {"factor": 2.0, "extra": 1}}}
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
