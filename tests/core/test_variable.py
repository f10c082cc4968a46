"""Variable and Parameter: data, roles, leaves, detach and the backward method."""

from __future__ import annotations

import re

import numpy as np
import pytest

from asyncgraph import Parameter, Variable, no_grad

from ._ops import Add, Mul


@pytest.mark.parametrize(
    "data",
    [
        "some text",
        ["a", "list", "of", "str"],
        3,
        2.5,
        None,
        True,
        [1, 2.0, None, False, "mixed"],
        {"answer": "42", "score": 0.5, "tags": ["a", "b"], "nested": {"ok": True}},
        [{"a": [1, 2]}, {"b": None}],
        np.arange(6.0).reshape(2, 3),
        np.float64(1.5),
    ],
    ids=repr,
)
def test_variable_accepts_supported_data_types(data: object) -> None:
    v = Variable(data, role="r")
    assert v.data is data
    assert v.role == "r"


@pytest.mark.parametrize(
    "data",
    [object(), {1, 2}, b"bytes", complex(1, 2), {1: "int key"}, [object()], {"k": {2j}}],
    ids=lambda data: re.sub(r" at 0x[0-9a-f]+", "", repr(data)),  # the same in every process
)
def test_variable_rejects_other_data_types_with_type_error(data: object) -> None:
    with pytest.raises(TypeError, match=r"Variable data must be|keys must be str"):
        Variable(data)


def test_variable_of_a_variable_is_a_type_error_pointing_to_detach() -> None:
    with pytest.raises(TypeError, match="detach"):
        Variable(Variable(1.0))


def test_variable_role_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="role"):
        Variable(1.0, role=3)  # type: ignore[arg-type]


def test_new_variable_is_a_leaf_without_grad() -> None:
    v = Variable("x")
    assert v.data == "x"
    assert v.role == ""
    assert v.requires_grad is False
    assert v.grad is None
    assert v.grad_fn is None
    assert v.is_leaf


def test_requires_grad_is_settable_on_leaves() -> None:
    v = Variable(1.0)
    v.requires_grad = True
    assert v.requires_grad
    v.requires_grad = False
    assert not v.requires_grad


def test_setting_requires_grad_on_a_non_leaf_raises() -> None:
    x = Variable(1.0, requires_grad=True)
    y = Add.apply(x, x)
    assert not y.is_leaf
    assert y.grad_fn is not None and y.grad_fn.name == "Add"
    with pytest.raises(RuntimeError, match="leaf"):
        y.requires_grad = False
    assert y.requires_grad


def test_assigning_true_on_a_non_leaf_raises_too_as_in_pytorch_2() -> None:
    x = Variable(1.0, requires_grad=True)
    y = Add.apply(x, x)
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        y.requires_grad = True
    assert y.requires_grad and not y.is_leaf


def test_requires_grad_underscore_true_on_a_non_leaf_is_a_no_op_false_raises() -> None:
    x = Variable(1.0, requires_grad=True)
    y = Add.apply(x, x)
    assert y.requires_grad_(True) is y and y.requires_grad_() is y
    with pytest.raises(RuntimeError, match=r"var\.detach"):
        y.requires_grad_(False)
    assert y.requires_grad


def test_parameter_is_a_leaf_that_requires_grad() -> None:
    p = Parameter("prompt", role="system")
    assert isinstance(p, Variable)
    assert p.is_leaf and p.requires_grad
    assert p.data == "prompt" and p.role == "system"
    assert p.grad is None


def test_leaf_creation_is_not_affected_by_no_grad() -> None:
    with no_grad():
        p = Parameter(1.0)
        v = Variable(2.0, requires_grad=True)
    assert p.requires_grad and p.is_leaf
    assert v.requires_grad and v.is_leaf


def test_detach_returns_a_new_leaf_with_same_data_and_role() -> None:
    x = Variable(2.0, role="x", requires_grad=True)
    y = Mul.apply(x, x)
    y.role = "y"
    d = y.detach()
    assert d is not y
    assert d.data == y.data and d.role == "y"
    assert d.is_leaf and not d.requires_grad
    assert d.grad_fn is None
    assert not Mul.apply(d, d).requires_grad  # cut from the graph


def test_grad_fn_is_not_writable() -> None:
    """As PyTorch's (and afnio's test_set_grad_fn_raises): only a Function sets it."""
    x = Variable(2.0, requires_grad=True)
    with pytest.raises(AttributeError, match="'grad_fn' of 'Variable' objects is not writable"):
        x.grad_fn = Mul.apply(x, x).grad_fn  # type: ignore[misc]
    assert x.is_leaf


def test_detach_in_place_makes_the_same_variable_a_leaf() -> None:
    x = Variable(2.0, role="x", requires_grad=True)
    y = Mul.apply(x, x)
    assert y.detach_() is y
    assert y.is_leaf and not y.requires_grad and y.grad_fn is None and y.data == 4.0
    assert not Mul.apply(y, y).requires_grad  # cut from the graph


def test_retain_grad_on_a_leaf_that_needs_no_grad_raises() -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        Variable(1.0).retain_grad()


@pytest.mark.anyio
async def test_backward_method_accumulates_into_leaves() -> None:
    x = Variable(3.0, role="x", requires_grad=True)
    y = Mul.apply(x, x)
    await y.backward()
    assert x.grad is not None
    assert isinstance(x.grad, Variable)
    assert x.grad.data == 6.0
    assert y.grad is None  # non-leaf grads are not kept unless retain_grad()


@pytest.mark.anyio
async def test_backward_method_takes_grad_retain_graph_create_graph_and_inputs() -> None:
    x = Variable(3.0, requires_grad=True)
    w = Variable(5.0, requires_grad=True)
    y = Mul.apply(x, w)
    await y.backward(2.0, retain_graph=True, inputs=[x])
    assert x.grad is not None and x.grad.data == 10.0
    assert w.grad is None
    await y.backward(Variable(1.0), create_graph=True, inputs=x)
    assert x.grad.data == 15.0
    assert x.grad.requires_grad  # create_graph: the gradient has history


@pytest.mark.anyio
async def test_backward_on_a_leaf_gives_its_own_implicit_grad() -> None:
    x = Variable(1.5, requires_grad=True)
    await x.backward()
    assert x.grad is not None and x.grad.data == 1.0


def test_repr_shows_data_role_and_grad_fn() -> None:
    x = Variable(1.0, role="x", requires_grad=True)
    assert repr(x) == "Variable(1.0, role='x', requires_grad=True)"
    assert "grad_fn=Add" in repr(Add.apply(x, x))
    assert repr(Parameter("p")).startswith("Parameter(")


def test_repr_truncates_long_values_and_roles() -> None:
    long = Variable("word " * 1000, role="input " * 64, requires_grad=True)
    text = repr(long)
    assert len(text) < 140
    assert text.startswith("Variable('word word")
    assert "...'" in text and "role='input input" in text
    from asyncgraph.text import concat

    parts = [
        Variable(str(i), role=f"part {i} of the prompt", requires_grad=True) for i in range(64)
    ]
    fan_in = concat(*parts)
    assert len(fan_in.role) > 1000  # the role names every input...
    assert len(repr(fan_in)) < 160  # ...but the repr stays one short line
    assert "grad_fn=Concat" in repr(fan_in)
