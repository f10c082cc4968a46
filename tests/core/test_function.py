"""Function: forward/backward styles, ctx, multiple outputs, and misuse errors."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import numpy as np
import pytest

import asyncgraph
from asyncgraph import (
    BackwardError,
    Function,
    FunctionCtx,
    GraphError,
    Variable,
    is_grad_enabled,
    no_grad,
)

from ._ops import Add, Mul


class Double(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data * 2)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return Variable(g.data * 2)


def test_instantiating_a_function_raises_pointing_to_apply() -> None:
    with pytest.raises(TypeError, match=r"Double.apply"):
        Double()


def test_apply_on_the_base_class_raises() -> None:
    with pytest.raises(TypeError, match="subclass"):
        Function.apply(Variable(1.0))


def test_sync_forward_apply_returns_the_output_directly() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Double.apply(x)
    assert isinstance(y, Variable)
    assert y.data == 4.0
    assert y.grad_fn is not None and y.grad_fn.name == "Double"
    assert y.requires_grad and not y.is_leaf


def test_apply_without_inputs_that_require_grad_records_nothing() -> None:
    y = Double.apply(Variable(2.0))
    assert y.is_leaf and not y.requires_grad


class AsyncForward(Function):
    @staticmethod
    async def forward(ctx: Any, x: Variable) -> Variable:
        ctx.scale = 3
        return Variable(x.data * 3)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        return Variable(g.data * ctx.scale)


@pytest.mark.anyio
async def test_async_forward_apply_returns_an_awaitable() -> None:
    x = Variable(2.0, requires_grad=True)
    pending = AsyncForward.apply(x)
    assert inspect.isawaitable(pending)
    y = await pending
    assert y.data == 6.0 and y.grad_fn is not None
    await y.backward()
    assert x.grad is not None and x.grad.data == 3.0


class WithSetupContext(Function):
    @staticmethod
    def forward(x: Variable, y: Variable) -> Variable:
        assert not is_grad_enabled()
        return Variable(x.data * y.data)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Variable) -> None:
        x, y = inputs
        ctx.save_for_backward(x, y)
        ctx.output_data = output.data

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        x, y = ctx.saved_variables
        assert ctx.output_data == x.data * y.data
        return Variable(g.data * y.data), Variable(g.data * x.data)


class AsyncSetupContext(Function):
    @staticmethod
    def forward(x: Variable) -> Variable:
        return Variable(x.data + 1)

    @staticmethod
    async def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Variable) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        assert len(ctx.saved_variables) == 1
        return Variable(g.data * 10)


@pytest.mark.anyio
async def test_forward_with_setup_context_style() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Variable(5.0, requires_grad=True)
    z = WithSetupContext.apply(x, y)
    assert isinstance(z, Variable) and z.data == 10.0
    await z.backward()
    assert x.grad is not None and x.grad.data == 5.0
    assert y.grad is not None and y.grad.data == 2.0


@pytest.mark.anyio
async def test_async_setup_context_makes_apply_awaitable() -> None:
    x = Variable(2.0, requires_grad=True)
    pending = AsyncSetupContext.apply(x)
    assert inspect.isawaitable(pending)
    y = await pending
    await y.backward()
    assert x.grad is not None and x.grad.data == 10.0


class Inspect(Function):
    """Records what forward and backward see."""

    seen: ClassVar[dict[str, Any]] = {}

    @staticmethod
    def forward(ctx: FunctionCtx, a: Variable, n: int, *, b: Variable, c: Variable) -> Variable:
        Inspect.seen["forward_grad_enabled"] = is_grad_enabled()
        ctx.save_for_backward(a, None, b)
        ctx.note = "free-form attribute"
        ctx.n = n
        return Variable(a.data * n + b.data + c.data)

    @staticmethod
    def backward(ctx: FunctionCtx, g: Variable) -> tuple[Any, ...]:
        Inspect.seen["needs"] = ctx.needs_input_grad
        Inspect.seen["saved"] = ctx.saved_variables
        Inspect.seen["note"] = ctx.note  # type: ignore[attr-defined]
        Inspect.seen["backward_grad_enabled"] = is_grad_enabled()
        return g.data * ctx.n, None, g.data, None  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_ctx_saves_variables_needs_input_grad_and_attributes() -> None:
    a = Variable(1.0, role="a", requires_grad=True)
    b = Variable(2.0, role="b", requires_grad=True)
    c = Variable(3.0, role="c")
    y = Inspect.apply(a, 4, b=b, c=c)
    assert y.data == 9.0
    assert y.grad_fn is not None
    assert y.grad_fn.input_roles == ("a", "", "b", "c")
    await y.backward()
    assert Inspect.seen["forward_grad_enabled"] is False
    assert Inspect.seen["backward_grad_enabled"] is False
    assert Inspect.seen["needs"] == (True, False, True, False)
    saved = Inspect.seen["saved"]
    assert saved[0] is a and saved[1] is None and saved[2] is b
    assert Inspect.seen["note"] == "free-form attribute"
    # raw data returned from backward is wrapped in a Variable
    assert a.grad is not None and a.grad.data == 4.0
    assert b.grad is not None and b.grad.data == 1.0
    assert c.grad is None


def test_save_for_backward_rejects_non_variables() -> None:
    ctx = FunctionCtx()
    with pytest.raises(TypeError, match="save_for_backward"):
        ctx.save_for_backward(Variable(1.0), 3.0)


class SplitHalves(Function):
    """Two outputs: (2x, 3x)."""

    grads_seen: ClassVar[list[tuple[Any, Any]]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
        return Variable(x.data * 2.0, role="double"), Variable(x.data * 3.0, role="triple")

    @staticmethod
    def backward(ctx: Any, g2: Variable | None, g3: Variable | None) -> float:
        SplitHalves.grads_seen.append(
            (None if g2 is None else g2.data, None if g3 is None else g3.data)
        )
        return (0.0 if g2 is None else 2.0 * g2.data) + (0.0 if g3 is None else 3.0 * g3.data)


@pytest.mark.anyio
async def test_multiple_outputs_get_one_gradient_each() -> None:
    SplitHalves.grads_seen.clear()
    x = Variable(1.0, requires_grad=True)
    d, t = SplitHalves.apply(x)
    assert (d.data, t.data) == (2.0, 3.0)
    assert d.grad_fn is t.grad_fn
    assert (d.output_nr, t.output_nr) == (0, 1)
    assert (d.role, t.role) == ("double", "triple")
    await asyncgraph.backward([d, t], [10.0, 100.0])
    assert SplitHalves.grads_seen == [(10.0, 100.0)]
    assert x.grad is not None and x.grad.data == 320.0


@pytest.mark.anyio
async def test_an_output_no_gradient_flowed_into_gets_a_zero_or_none() -> None:
    """As PyTorch's materialized gradients (test_set_materialize_grads): a number or
    array output that got no gradient reaches backward as a zero of its kind, or as None
    after ``ctx.set_materialize_grads(False)``; a text output, which has no zero, as None."""
    SplitHalves.grads_seen.clear()
    x = Variable(1.0, requires_grad=True)
    _, t = SplitHalves.apply(x)
    await Mul.apply(t, t).backward()
    assert SplitHalves.grads_seen == [(0.0, 6.0)]
    assert x.grad is not None and x.grad.data == 18.0

    class Pair(Function):
        seen: ClassVar[list[Any]] = []

        @staticmethod
        def forward(ctx: Any, x: Variable, materialize: bool) -> tuple[Variable, ...]:
            ctx.set_materialize_grads(materialize)
            return Variable(np.full(2, x.data)), Variable(x.data), Variable("text")

        @staticmethod
        def backward(ctx: Any, *grads: Variable | None) -> tuple[Any, None]:
            Pair.seen.append([None if g is None else g.data for g in grads])
            return sum(float(np.sum(g.data)) for g in grads if g is not None), None

    y = Pair.apply(Variable(1.0, requires_grad=True), True)[1]
    await y.backward()
    zeros, one, text = Pair.seen.pop()
    assert one == 1.0 and text is None
    assert zeros.dtype == np.float64 and zeros.tolist() == [0.0, 0.0]
    y = Pair.apply(Variable(1.0, requires_grad=True), False)[1]
    await y.backward()
    assert Pair.seen.pop() == [None, 1.0, None]

    class Block(Function):
        """Passes no gradient back."""

        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            return Variable(x.data)

        @staticmethod
        def backward(ctx: Any, g: Variable) -> None:
            return None

    # A node none of whose outputs got a gradient is skipped, not run on zeros.
    SplitHalves.grads_seen.clear()
    x = Variable(1.0, requires_grad=True)
    await Block.apply(SplitHalves.apply(x)[1]).backward()
    assert SplitHalves.grads_seen == [] and x.grad is None


class WithIndex(Function):
    seen: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
        index = Variable(7)
        ctx.mark_non_differentiable(index)
        return Variable(x.data * 2), index

    @staticmethod
    def backward(ctx: Any, g: Variable | None, g_index: Variable | None) -> Variable | None:
        WithIndex.seen.append(g_index)
        return None if g is None else Variable(g.data * 2)


@pytest.mark.anyio
async def test_mark_non_differentiable_outputs_have_no_history_and_get_a_zero() -> None:
    WithIndex.seen.clear()
    x = Variable(1.0, requires_grad=True)
    y, index = WithIndex.apply(x)
    assert y.requires_grad and not y.is_leaf
    assert index.is_leaf and not index.requires_grad
    await y.backward()
    (g_index,) = WithIndex.seen  # a zero of its type, as PyTorch's zero tensor
    assert g_index is not None and g_index.data == 0 and type(g_index.data) is int
    assert x.grad is not None and x.grad.data == 2.0


class Identity(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return x

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


@pytest.mark.anyio
async def test_returning_an_input_from_forward_keeps_the_input_a_leaf() -> None:
    x = Variable(1.0, role="x", requires_grad=True)
    y = Identity.apply(x)
    assert y is not x
    assert x.is_leaf and y.grad_fn is not None
    assert y.role == "x"
    await y.backward()
    assert x.grad is not None and x.grad.data == 1.0


class RawForward(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[str, float]:
        return "text", 1.0

    @staticmethod
    def backward(ctx: Any, g_text: Variable | None, g_num: Variable | None) -> str:
        return "feedback"


@pytest.mark.anyio
async def test_raw_data_from_forward_and_backward_is_wrapped() -> None:
    x = Variable("in", requires_grad=True)
    text, num = RawForward.apply(x)
    assert isinstance(text, Variable) and text.data == "text" and text.requires_grad
    assert isinstance(num, Variable) and num.data == 1.0
    await text.backward()
    assert x.grad is not None and x.grad.data == "feedback"


class TooFew(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


class GradForConstant(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        return g, g


@pytest.mark.anyio
async def test_wrong_number_of_gradients_is_an_error_naming_the_function() -> None:
    a = Variable(1.0, role="a", requires_grad=True)
    y = TooFew.apply(a, Variable(2.0, role="b"))
    with pytest.raises(BackwardError, match="TooFew") as info:
        await y.backward()
    assert info.value.function == "TooFew"
    assert isinstance(info.value.__cause__, GraphError)
    assert "returned an incorrect number of gradients (expected 2, got 1)" in str(info.value)
    assert "2 input(s)" in str(info.value)
    assert a.grad is None


@pytest.mark.anyio
async def test_gradient_for_a_variable_that_needs_none_is_dropped_silently() -> None:
    # As PyTorch: many backwards compute every input's gradient without reading
    # ctx.needs_input_grad (an LLM critique often answers for every input).
    a = Variable(1.0, role="a", requires_grad=True)
    const = Variable(2.0, role="const")
    y = GradForConstant.apply(a, const)
    await y.backward(Variable(5.0))
    assert a.grad is not None and a.grad.data == 5.0
    assert const.grad is None


class GradForAPlainValue(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, scale: float) -> Variable:
        return Variable(a.data * scale)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        return g, g


@pytest.mark.anyio
async def test_gradient_for_an_input_that_is_not_a_variable_is_an_error() -> None:
    a = Variable(1.0, role="a", requires_grad=True)
    y = GradForAPlainValue.apply(a, 3.0)
    with pytest.raises(BackwardError, match="GradForAPlainValue") as info:
        await y.backward()
    assert isinstance(info.value.__cause__, GraphError)
    assert (
        "returned a gradient different than None at position 2, but the corresponding "
        "forward input was not a Variable" in str(info.value)
    )
    assert a.grad is None


class TrailingNones(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data * b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        return Variable(g.data * 2), Variable(g.data * 3), None, None


class TrailingGradient(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        return Variable(a.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        return g, None, g


@pytest.mark.anyio
async def test_extra_trailing_nones_are_accepted_but_extra_gradients_are_not() -> None:
    a = Variable(1.0, role="a", requires_grad=True)
    b = Variable(1.0, role="b", requires_grad=True)
    await TrailingNones.apply(a, b).backward()
    assert (a.grad.data, b.grad.data) == (2.0, 3.0)  # type: ignore[union-attr]
    with pytest.raises(BackwardError, match=r"incorrect number of gradients \(expected 1, got 3\)"):
        await TrailingGradient.apply(Variable(1.0, requires_grad=True)).backward()


class ScaleWithDefault(Function):
    seen: tuple[Any, ...] = ()

    @staticmethod
    def forward(x: Variable, scale: float = 2.0) -> Variable:
        return Variable(x.data * scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Variable) -> None:
        ScaleWithDefault.seen = inputs
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        return Variable(g.data * ctx.scale), None


@pytest.mark.anyio
async def test_setup_context_receives_forwards_defaults() -> None:
    x = Variable(3.0, role="x", requires_grad=True)
    y = ScaleWithDefault.apply(x)
    assert ScaleWithDefault.seen == (x, 2.0)
    assert y.data == 6.0
    await y.backward()
    assert x.grad is not None and x.grad.data == 2.0  # counted against (x, 2.0)
    x.grad = None
    ScaleWithDefault.apply(x, scale=5.0)
    assert ScaleWithDefault.seen == (x, 5.0)
    await ScaleWithDefault.apply(x, 4.0).backward()
    assert x.grad is not None and x.grad.data == 4.0


class PortedFromTorch(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        ctx.save_for_backward(a, b)
        return Variable(a.data * b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        a, b = ctx.saved_tensors
        return Variable(g.data * b.data), Variable(g.data * a.data)


@pytest.mark.anyio
async def test_saved_tensors_is_an_alias_of_saved_variables() -> None:
    a = Variable(2.0, requires_grad=True)
    b = Variable(5.0, requires_grad=True)
    y = PortedFromTorch.apply(a, b)
    assert y.grad_fn is not None
    assert y.grad_fn.ctx.saved_tensors == y.grad_fn.ctx.saved_variables == (a, b)
    await y.backward()
    assert (a.grad.data, b.grad.data) == (5.0, 2.0)  # type: ignore[union-attr]
    with pytest.raises(GraphError, match="second time"):
        y.grad_fn.ctx.saved_tensors  # noqa: B018


def test_forward_returning_an_empty_tuple_is_an_error() -> None:
    class Empty(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> tuple[()]:
            return ()

        @staticmethod
        def backward(ctx: Any) -> None:
            return None

    with pytest.raises(TypeError, match=r"Empty\.forward"):
        Empty.apply(Variable(1.0, requires_grad=True))


def test_invalid_dispatch_is_rejected_at_class_creation() -> None:
    with pytest.raises(ValueError, match="dispatch"):

        class Bad(Function):
            dispatch = "elsewhere"  # type: ignore[assignment]


@pytest.mark.anyio
async def test_shared_input_gradients_from_two_consumers_are_summed() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Add.apply(Mul.apply(x, x), x)  # x**2 + x
    await y.backward()
    assert x.grad is not None and x.grad.data == 5.0


class SeesNeeds(Function):
    seen: ClassVar[list[tuple[tuple[bool, ...], bool]]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable, y: Any) -> Variable:
        SeesNeeds.seen.append((ctx.needs_input_grad, ctx.recorded))
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        return g, None


def test_needs_input_grad_follows_each_inputs_requires_grad_even_under_no_grad() -> None:
    """PyTorch's rule (python_function.cpp, unpack_input): needs_input_grad[i] is whether
    input i is a Tensor that requires grad, whatever the grad mode; only recording
    depends on the mode. ``ctx.recorded`` says which."""
    SeesNeeds.seen.clear()
    x = Variable(1.0, requires_grad=True)
    with no_grad():
        out = SeesNeeds.apply(x, Variable(2.0))
    assert out.grad_fn is None
    SeesNeeds.seen.append(((), False))  # a separator, for the reader of a failure
    SeesNeeds.apply(x, Variable(2.0))
    SeesNeeds.apply(Variable(1.0), 3)
    with no_grad():
        SeesNeeds.apply(x, Variable(2.0, requires_grad=True))
    assert SeesNeeds.seen == [
        ((True, False), False),
        ((), False),
        ((True, False), True),
        ((False, False), False),
        ((True, True), False),
    ]


class DoubleMul2(Function):
    """PyTorch's DoubleMul2 (test_grad_fn_prehooks_multiple_outputs): the middle output is
    the raw number ``a``, not a Variable."""

    seen: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable, a: Any, y: Variable) -> tuple[Any, ...]:
        ctx.a = a
        return Variable(a * x.data * 2), a, Variable(a * y.data * 2)

    @staticmethod
    def backward(ctx: Any, g1: Variable, ga: Variable | None, g2: Variable) -> tuple[Any, ...]:
        DoubleMul2.seen.append(ga)
        return ctx.a * g1.data * 2, None, ctx.a * g2.data * 2


@pytest.mark.anyio
async def test_a_raw_output_gets_none_in_backward() -> None:
    # Ported from test_grad_fn_prehooks_multiple_outputs: backward's gradient for the raw
    # output ``a`` is None.
    DoubleMul2.seen.clear()
    a = Variable(1.5, requires_grad=True)
    b = Variable(-2.0, requires_grad=True)
    c, k, d = DoubleMul2.apply(a, 3, b)
    assert isinstance(k, Variable) and k.data == 3
    await Add.apply(c, d).backward()
    assert DoubleMul2.seen == [None]
    assert a.grad is not None and a.grad.data == 6.0
    assert b.grad is not None and b.grad.data == 6.0


class WithRaw(Function):
    seen: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable, value: Any) -> tuple[Variable, Any]:
        return Variable(x.data * 2), value

    @staticmethod
    def backward(ctx: Any, g: Variable, g_raw: Variable | None) -> tuple[Any, None]:
        WithRaw.seen.append(g_raw)
        return g.data * 2, None


@pytest.mark.anyio
@pytest.mark.parametrize("value", [3, 2.5, True, None, "text", [1, 2]])
async def test_a_raw_value_forward_returns_gets_none_whatever_the_value(value: Any) -> None:
    """PyTorch passes None to backward for a non-Tensor output (PyNode::apply materializes
    zeros only for Tensors): asyncgraph wraps the raw value in a Variable, and backward
    receives None for it when no gradient reaches it, a number as much as text."""
    WithRaw.seen.clear()
    x = Variable(1.0, requires_grad=True)
    out, raw = WithRaw.apply(x, value)
    assert isinstance(raw, Variable) and raw.data == value
    await out.backward()
    assert WithRaw.seen == [None]
    assert x.grad is not None and x.grad.data == 2.0


@pytest.mark.anyio
async def test_a_raw_text_output_still_gets_none_and_a_variable_output_still_gets_a_zero() -> None:
    class Mixed(Function):
        seen: ClassVar[list[Any]] = []

        @staticmethod
        def forward(ctx: Any, x: Variable) -> tuple[Any, ...]:
            return Variable(x.data), 7, Variable(0)

        @staticmethod
        def backward(ctx: Any, *grads: Variable | None) -> Any:
            Mixed.seen.append([None if g is None else g.data for g in grads])
            return grads[0]

    x = Variable(1.0, requires_grad=True)
    out, _, _ = Mixed.apply(x)
    await out.backward()
    assert Mixed.seen == [[1.0, None, 0]]


class OnceDifferentiable(Function):
    """PyTorch's test_once_differentiable MyFunction: t1 + pyscalar * t2 + t1 * t2, with a
    backward on raw data."""

    grad_enabled: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, t1: Variable, pyscalar: float, t2: Variable) -> Variable:
        ctx.pyscalar = pyscalar
        ctx.save_for_backward(t1, t2)
        return Variable(t1.data + pyscalar * t2.data + t1.data * t2.data)

    @staticmethod
    @asyncgraph.once_differentiable
    def backward(ctx: Any, g: Variable) -> tuple[Any, None, Any]:
        OnceDifferentiable.grad_enabled.append(is_grad_enabled())
        t1, t2 = ctx.saved_variables
        return g.data + g.data * t2.data, None, g.data * ctx.pyscalar + g.data * t1.data


class AsyncOnceDifferentiable(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        ctx.save_for_backward(x)
        return Variable(x.data**3)

    @staticmethod
    @asyncgraph.once_differentiable
    async def backward(ctx: Any, g: Variable) -> Any:
        (x,) = ctx.saved_variables
        return 3 * x.data**2 * g.data


def graph_desc(fn: Any) -> str:
    """PyTorch's graph_desc (test_autograd.py), on asyncgraph's names."""
    if fn is None:
        return "None"
    inner = ", ".join(graph_desc(next_fn) for next_fn, _ in fn.next_functions)
    return f"{fn.name}({inner})"


@pytest.mark.anyio
async def test_once_differentiable_gives_first_gradients_and_refuses_a_second() -> None:
    # Ported from test_once_differentiable (with _function_test's checks).
    OnceDifferentiable.grad_enabled.clear()
    x = Variable(0.5, requires_grad=True)
    y = Variable(-1.5, requires_grad=True)
    result = OnceDifferentiable.apply(x, 2, y)
    go = Variable(1.0, requires_grad=True)
    await result.backward(go, create_graph=True)
    assert OnceDifferentiable.grad_enabled == [False]  # the backward ran under no_grad
    assert x.grad is not None and x.grad.data == y.data + 1
    assert y.grad is not None and y.grad.data == x.data + 2
    assert x.grad.grad_fn is not None and y.grad.grad_fn is not None
    # PyTorch: 'CopyBackwards(None, Error(AccumulateGrad(), None, AccumulateGrad()))': a
    # .grad is a copy of its own, whose node leads to the error node.
    assert graph_desc(x.grad.grad_fn) == (
        "_GradCopy(DelayedError(AccumulateGrad(), None, AccumulateGrad()))"
    )
    assert graph_desc(y.grad.grad_fn) == graph_desc(x.grad.grad_fn)
    with pytest.raises(
        BackwardError,
        match=r"trying to differentiate twice a function that was marked with "
        r"@once_differentiable \(OnceDifferentiable\.backward\)",
    ) as info:
        await x.grad.backward()
    assert isinstance(info.value.__cause__, GraphError)
    assert x.grad.data == y.data + 1  # nothing committed


@pytest.mark.anyio
async def test_once_differentiable_without_create_graph_or_history_is_plain() -> None:
    x = Variable(0.5, requires_grad=True)
    y = Variable(-1.5, requires_grad=True)
    await OnceDifferentiable.apply(x, 2, y).backward()
    assert x.grad is not None and x.grad.grad_fn is None and x.grad.data == -0.5
    # create_graph with a gradient that does not require grad: nothing to guard (PyTorch's
    # rule reads the gradients backward receives).
    x.grad = None
    await OnceDifferentiable.apply(x, 2, y).backward(create_graph=True)
    assert x.grad is not None and x.grad.grad_fn is None


@pytest.mark.anyio
async def test_once_differentiable_wraps_an_async_backward() -> None:
    assert inspect.iscoroutinefunction(AsyncOnceDifferentiable.backward)
    x = Variable(2.0, requires_grad=True)
    out = AsyncOnceDifferentiable.apply(x)
    (gx,) = await asyncgraph.grad(out, x, Variable(1.0, requires_grad=True), create_graph=True)
    assert gx is not None and gx.data == 12.0
    assert gx.grad_fn is not None and gx.grad_fn.name == "DelayedError"
    with pytest.raises(BackwardError, match=r"AsyncOnceDifferentiable\.backward"):
        await gx.backward()
    assert x.grad is None


class MulInplace(Function):
    """``x *= k`` in place, as PyTorch's mul_: x's data changes and x is marked dirty."""

    @staticmethod
    def forward(ctx: Any, x: Variable, k: float) -> Variable:
        x.data = x.data * k
        ctx.mark_dirty(x)
        ctx.k = k
        return x

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, None]:
        return g.data * ctx.k, None


class DoubleInplace(Function):
    """PyTorch's DoubleInplace (test_return_duplicate_inplace): returns x twice."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
        x.data = x.data * 2
        ctx.mark_dirty(x)
        return x, x

    @staticmethod
    def backward(ctx: Any, g1: Variable, g2: Variable) -> Any:
        return g1.data * 2 + g2.data * 2


def clone(x: Variable) -> Variable:
    from ._ops import Identity

    out: Variable = Identity.apply(x)
    return out


@pytest.mark.anyio
async def test_mark_dirty_returns_the_input_itself_with_a_new_history() -> None:
    x = Variable(2.0, requires_grad=True)
    a = clone(x)
    before = a.grad_fn
    b = MulInplace.apply(a, 3)
    assert b is a and a.data == 6.0 and a._version == 1
    assert a.grad_fn is not None and a.grad_fn is not before and a.grad_fn.name == "MulInplace"
    assert a.grad_fn.next_functions == ((before, 0), (None, 0))  # the old history behind it
    await a.backward()
    assert x.grad is not None and x.grad.data == 3.0


@pytest.mark.anyio
async def test_return_duplicate_inplace() -> None:
    # Ported from test_return_duplicate_inplace (its gradcheck done by hand: 4 * x).
    x = Variable(1.5, requires_grad=True)
    a, b = DoubleInplace.apply(clone(x))
    assert a is b
    await Add.apply(a, b).backward()
    assert x.grad is not None and x.grad.data == 4.0
    # Can't modify leaf variables in-place
    with pytest.raises(
        GraphError, match="a leaf Variable that requires grad has been used in an in-place"
    ):
        MulInplace.apply(x, 2)
    assert x.data == 3.0 and x.is_leaf  # forward ran; the error is in recording it


@pytest.mark.anyio
async def test_mark_dirty_under_no_grad_and_on_a_leaf_that_needs_no_gradient() -> None:
    x = Variable(2.0, requires_grad=True)
    with no_grad():  # in place on a leaf, under no_grad(): allowed, as in PyTorch
        assert MulInplace.apply(x, 2) is x
    assert x.is_leaf and x.data == 4.0 and x._version == 1

    class AddInplace(Function):
        @staticmethod
        def forward(ctx: Any, acc: Variable, w: Variable) -> Variable:
            acc.data = acc.data + w.data
            ctx.mark_dirty(acc)
            return acc

        @staticmethod
        def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
            return g, g

    acc = Variable(1.0)
    w = Variable(5.0, requires_grad=True)
    assert AddInplace.apply(acc, w) is acc
    assert acc.data == 6.0 and not acc.is_leaf and acc.requires_grad
    await acc.backward()
    assert w.grad is not None and w.grad.data == 1.0


def test_mark_dirty_needs_the_dirty_input_returned_and_warns_for_a_non_input() -> None:
    class NotReturned(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            ctx.mark_dirty(x)
            return Variable(x.data)

        @staticmethod
        def backward(ctx: Any, g: Variable) -> Variable:
            return g

    with pytest.raises(GraphError, match="Some elements marked as dirty during the forward"):
        NotReturned.apply(clone(Variable(1.0, requires_grad=True)))
    with no_grad(), pytest.raises(GraphError, match=r"NotReturned\.forward"):
        NotReturned.apply(Variable(1.0))

    class NotAnInput(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            out = Variable(x.data)
            ctx.mark_dirty(out)
            return out

        @staticmethod
        def backward(ctx: Any, g: Variable) -> Variable:
            return g

    with pytest.warns(UserWarning, match=r"Only input Variables should be given to"):
        NotAnInput.apply(Variable(1.0, requires_grad=True))
    with pytest.raises(TypeError, match="mark_dirty expects the input Variables"):
        FunctionCtx().mark_dirty(1.0)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_saved_variable_changed_in_place_afterwards_is_an_error_at_backward() -> None:
    # PyTorch's mark_dirty docstring example: b saved a, then a changed in place.
    x = Variable(1.0, requires_grad=True)
    a = clone(x)
    b = Mul.apply(a, a)  # saves a at version 0
    MulInplace.apply(a, 2)
    with pytest.raises(BackwardError, match="modified by an inplace operation") as info:
        await b.backward()
    assert isinstance(info.value.__cause__, GraphError)
    assert "is at version 1; expected version 0 instead" in str(info.value)
    assert x.grad is None

    class SaveThenChange(Function):
        """Saves its input, then changes it in place: saved after the change, no error."""

        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            ctx.save_for_backward(x)
            x.data = x.data * 3
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx: Any, g: Variable) -> Any:
            (saved,) = ctx.saved_variables
            assert saved.data == 3.0  # the value after the change
            return g.data * 3

    x = Variable(1.0, requires_grad=True)
    await SaveThenChange.apply(clone(x)).backward()
    assert x.grad is not None and x.grad.data == 3.0


@pytest.mark.anyio
async def test_retain_grad_inplace() -> None:
    # Ported from test_retain_grad_inplace: the gradient of the latest version.
    a = clone(Variable(1.0, requires_grad=True))
    a.retain_grad()
    MulInplace.apply(a, 2)
    await a.backward()
    assert a.grad is not None and a.grad.data == 1.0

    a = clone(Variable(1.0, requires_grad=True))
    a.retain_grad()
    MulInplace.apply(a, 2)  # in place several times is OK
    MulInplace.apply(a, 2)
    await a.backward()
    assert a.grad is not None and a.grad.data == 1.0


@pytest.mark.anyio
async def test_tensor_hooks_inplace() -> None:
    # Ported from test_tensor_hooks_inplace: a hook registered before the in-place change
    # sees the old version's gradient, one registered after sees the new version's.
    seen: list[tuple[str, float]] = []

    def fn1(g: Variable) -> Variable:
        seen.append(("fn1", g.data))  # x2 from the mul, x2 from fn2
        return Variable(g.data * 2)

    def fn2(g: Variable) -> Variable:
        seen.append(("fn2", g.data))
        return Variable(g.data * 2)

    a = Variable(1.0, requires_grad=True)
    b = clone(a)
    b.register_hook(fn1)
    MulInplace.apply(b, 2)
    b.register_hook(fn2)
    await b.backward()
    assert seen == [("fn2", 1.0), ("fn1", 4.0)]
    assert a.grad is not None and a.grad.data == 8.0


@pytest.mark.anyio
async def test_retains_grad_inplace_multiple_outputs() -> None:
    # Ported from test_retains_grad_inplace_multiple_outputs (DoubleMul).
    class DoubleMul(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
            return Variable(x.data * 2), Variable(x.data * 3)

        @staticmethod
        def backward(ctx: Any, g1: Variable, g2: Variable) -> Any:
            return g1.data * 2 + g2.data * 3

    var, mean = DoubleMul.apply(Variable(0.7, requires_grad=True))
    var.retain_grad()
    mean.retain_grad()
    MulInplace.apply(var, 2)  # var's retain_grad leaves the multi-output node
    await Add.apply(var, mean).backward()
    var2, mean2 = DoubleMul.apply(Variable(0.7, requires_grad=True))
    MulInplace.apply(var2, 2)
    expected = await asyncgraph.grad(Add.apply(var2, mean2), [var2, mean2])
    assert var.grad is not None and mean.grad is not None
    assert (var.grad.data, mean.grad.data) == tuple(g.data for g in expected if g is not None)


class Tagged(Function):
    """A Function with an option keyword (``label``) beside its inputs."""

    option_keywords = frozenset({"label"})
    seen: ClassVar[list[tuple[bool, ...]]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable, *rest: Any, label: str = "", **named: Any) -> Variable:
        ctx.label = label
        return Variable(x.data + sum(v.data for v in (*rest, *named.values())), role=label)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        Tagged.seen.append(tuple(ctx.needs_input_grad))
        return tuple(g if need else None for need in ctx.needs_input_grad)


class TaggedSetup(Function):
    option_keywords = frozenset({"scale"})
    seen: tuple[Any, ...] = ()

    @staticmethod
    def forward(x: Variable, scale: float = 2.0) -> Variable:
        return Variable(x.data * scale)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Variable) -> None:
        TaggedSetup.seen = inputs

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return Variable(g.data * 2.0)


@pytest.mark.anyio
async def test_option_keywords_reach_forward_but_are_not_inputs() -> None:
    x = Variable(1.0, role="x", requires_grad=True)
    y = Variable(2.0, role="y", requires_grad=True)
    z = Variable(3.0, role="z")
    out = Tagged.apply(x, z, label="sum", y=y)
    assert out.data == 6.0 and out.role == "sum"
    assert out.grad_fn is not None and out.grad_fn.ctx.label == "sum"
    # x, z, then y: the option has no entry, no edge, and backward returns nothing for it.
    assert out.grad_fn.ctx.needs_input_grad == (True, False, True)
    assert len(out.grad_fn.next_functions) == 3
    Tagged.seen.clear()
    await out.backward()
    assert Tagged.seen == [(True, False, True)]
    assert x.grad is not None and y.grad is not None and x.grad.data == y.grad.data == 1.0
    # With setup_context, its inputs leave the option out too (given or defaulted).
    TaggedSetup.apply(x, scale=3.0)
    assert TaggedSetup.seen == (x,)
    TaggedSetup.apply(x)
    assert TaggedSetup.seen == (x,)


def test_a_variable_given_to_an_option_keyword_is_a_type_error() -> None:
    x = Variable(1.0, requires_grad=True)
    with pytest.raises(TypeError, match=r"Tagged: option label= must be plain data, got a Var"):
        Tagged.apply(x, label=Variable("sum", requires_grad=True))


def test_option_keywords_given_as_a_tuple_are_one_set_and_a_string_is_refused() -> None:
    from typing import Any as _Any

    from asyncgraph import Function as _Function
    from asyncgraph import Variable as _Variable

    class Scaled(_Function):
        option_keywords = ("scale",)  # type: ignore[assignment]

        @staticmethod
        def forward(ctx: _Any, x: _Variable, *, scale: float) -> _Variable:
            return _Variable(x.data * scale)

    assert Scaled.option_keywords == frozenset({"scale"})
    assert Scaled.apply(_Variable(2.0, requires_grad=True), scale=3.0).data == 6.0
    with pytest.raises(TypeError, match="option_keywords names keyword arguments"):

        class Bad(_Function):
            option_keywords = "scale"  # type: ignore[assignment]
