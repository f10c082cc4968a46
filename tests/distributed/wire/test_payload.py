"""A Function's remote identity and how its ctx travels."""

from __future__ import annotations

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
    back = ctx_from_state(ctx_state(ctx), Named)
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
    error = diagnose_unpackable("Named", ctx, {})
    assert "Named" in str(error) and "'handle'" in str(error)
