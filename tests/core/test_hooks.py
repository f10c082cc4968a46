"""Gradient hooks on leaves and non-leaves; retain_grad."""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Function, Variable, grad
from asyncgraph._core._graph import RemovableHandle

from ._ops import Add, Mul, SinCos


@pytest.mark.anyio
async def test_leaf_hook_sees_the_gradient_and_can_replace_it() -> None:
    x = Variable(3.0, role="x", requires_grad=True)
    seen: list[float] = []

    def hook(g: Variable) -> Variable:
        seen.append(g.data)
        return Variable(g.data * 10)

    handle = x.register_hook(hook)
    assert isinstance(handle, RemovableHandle)
    await Mul.apply(x, x).backward()
    assert seen == [6.0]  # the summed gradient, once
    assert x.grad is not None and x.grad.data == 60.0


@pytest.mark.anyio
async def test_hook_returning_none_keeps_the_gradient() -> None:
    x = Variable(3.0, requires_grad=True)
    x.register_hook(lambda g: None)
    await Mul.apply(x, x).backward()
    assert x.grad is not None and x.grad.data == 6.0


@pytest.mark.anyio
async def test_hook_may_return_raw_data() -> None:
    x = Variable("draft", requires_grad=True)
    h = Add.apply(x, x)  # "draftdraft"
    h.register_hook(lambda g: "rewritten")
    await h.backward()
    assert x.grad is not None and x.grad.data == ["rewritten", "rewritten"]


@pytest.mark.anyio
async def test_async_hooks_run_and_can_replace() -> None:
    x = Variable(2.0, requires_grad=True)
    started = anyio.Event()

    async def hook(g: Variable) -> Variable:
        started.set()
        await anyio.lowlevel.checkpoint()
        return Variable(g.data + 1)

    x.register_hook(hook)
    await Mul.apply(x, Variable(5.0)).backward()
    assert started.is_set()
    assert x.grad is not None and x.grad.data == 6.0


@pytest.mark.anyio
async def test_non_leaf_hook_changes_the_gradient_flowing_further() -> None:
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    seen: list[float] = []

    def double(g: Variable) -> Variable:
        seen.append(g.data)
        return Variable(g.data * 2)

    h.register_hook(double)
    y = Add.apply(Mul.apply(h, Variable(3.0)), h)  # dy/dh = 4, summed before the hook
    await y.backward()
    assert seen == [4.0]
    assert x.grad is not None and x.grad.data == 8.0 * 2 * 2.0
    assert h.grad is None  # hooks do not retain


@pytest.mark.anyio
async def test_hooks_on_each_output_of_a_multi_output_node() -> None:
    x = Variable(0.0, requires_grad=True)
    s, c = SinCos.apply(x)
    calls: list[str] = []
    s.register_hook(lambda g: calls.append(f"sin {g.data}"))
    c.register_hook(lambda g: calls.append(f"cos {g.data}"))
    await Add.apply(s, c).backward()
    assert sorted(calls) == ["cos 1.0", "sin 1.0"]
    assert x.grad is not None and x.grad.data == 1.0  # cos(0) - sin(0)


@pytest.mark.anyio
async def test_hooks_run_in_registration_order_each_seeing_the_previous_result() -> None:
    x = Variable(1.0, requires_grad=True)
    order: list[tuple[str, float]] = []

    def add_one(g: Variable) -> Variable:
        order.append(("add_one", g.data))
        return Variable(g.data + 1)

    async def times_ten(g: Variable) -> Variable:
        order.append(("times_ten", g.data))
        return Variable(g.data * 10)

    def observe(g: Variable) -> None:
        order.append(("observe", g.data))

    x.register_hook(add_one)
    x.register_hook(times_ten)
    x.register_hook(observe)
    await Mul.apply(x, Variable(2.0)).backward()
    assert order == [("add_one", 2.0), ("times_ten", 3.0), ("observe", 30.0)]
    assert x.grad is not None and x.grad.data == 30.0


@pytest.mark.anyio
async def test_removed_hooks_are_not_called() -> None:
    x = Variable(1.0, requires_grad=True)
    calls: list[str] = []
    kept = x.register_hook(lambda g: calls.append("kept"))
    removed = x.register_hook(lambda g: calls.append("removed"))
    removed.remove()
    removed.remove()  # idempotent
    h = Mul.apply(x, Variable(2.0))
    h_handle = h.register_hook(lambda g: calls.append("non-leaf removed"))
    h_handle.remove()
    await h.backward()
    assert calls == ["kept"]
    kept.remove()
    await Mul.apply(x, Variable(2.0)).backward()
    assert calls == ["kept"]


def test_register_hook_on_a_variable_that_needs_no_grad_raises() -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        Variable(1.0).register_hook(lambda g: g)


def test_register_hook_requires_a_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        Variable(1.0, requires_grad=True).register_hook("not callable")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_failing_hook_fails_the_pass_naming_the_variable() -> None:
    x = Variable(1.0, role="weights", requires_grad=True)

    def broken(g: Variable) -> None:
        raise ValueError("bad hook")

    x.register_hook(broken)
    with pytest.raises(BackwardError, match="weights") as info:
        await Mul.apply(x, Variable(2.0)).backward()
    assert isinstance(info.value.__cause__, ValueError)
    assert x.grad is None


@pytest.mark.anyio
async def test_retain_grad_keeps_a_non_leaf_gradient() -> None:
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    other = Mul.apply(x, Variable(1.0))
    h.retain_grad()
    assert h.retains_grad and not other.retains_grad
    y = Mul.apply(h, Variable(3.0))
    await y.backward(retain_graph=True)
    assert h.grad is not None and h.grad.data == 3.0
    assert other.grad is None
    await y.backward()  # retained gradients accumulate like leaves'
    assert h.grad.data == 6.0


@pytest.mark.anyio
async def test_retained_gradient_is_the_hooked_gradient() -> None:
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    h.retain_grad()
    h.register_hook(lambda g: Variable(g.data * 100))
    await h.backward()
    assert h.grad is not None and h.grad.data == 100.0


@pytest.mark.anyio
async def test_retain_grad_fills_grad_inside_grad_calls_too() -> None:
    """PyTorch runs a node's retains_grad hooks with its tensor hooks in every pass that
    reaches it (Engine::evaluate_function calls call_tensor_pre_hooks for grad() too):
    a retained variable gets .grad from grad(); the leaves' .grad stay untouched."""
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    h.retain_grad()
    y = Mul.apply(h, h)
    (gx,) = await grad(y, x, retain_graph=True)
    assert gx is not None and gx.data == 2 * 4.0 * 2 * 2.0
    assert h.grad is not None and h.grad.data == 8.0 and x.grad is None
    # Accumulated like any .grad, whichever pass it comes from.
    await y.backward()
    assert h.grad.data == 16.0 and x.grad is not None and x.grad.data == 32.0

    # A retained variable that is itself an input of grad(): captured and retained both.
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    h.retain_grad()
    (gh,) = await grad(Mul.apply(h, h), h)
    assert gh is not None and gh.data == 8.0
    assert h.grad is not None and h.grad.data == 8.0 and h.grad is not gh


@pytest.mark.anyio
async def test_a_grad_call_that_fails_leaves_retained_grads_unchanged() -> None:
    class Fails(Function):
        @staticmethod
        def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
            return Variable(a.data + b.data)

        @staticmethod
        def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
            raise ValueError("no")

    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)
    h.retain_grad()
    y = Fails.apply(Mul.apply(h, Variable(1.0)), Mul.apply(x, Variable(1.0)))
    with pytest.raises(BackwardError, match="no"):
        await grad(y, x)
    assert h.grad is None


class NoneGradient(Function):
    """PyTorch's NoneGradientFunction (test_hook_none): two outputs; the second input needs
    no gradient."""

    @staticmethod
    def forward(ctx: Any, x: Variable, y: Variable) -> tuple[Variable, Variable]:
        assert ctx.needs_input_grad == (True, False)
        return Variable(x.data), Variable(y.data)

    @staticmethod
    def backward(ctx: Any, gx: Variable | None, gy: Variable | None) -> tuple[Any, None]:
        return gx, None


@pytest.mark.anyio
async def test_hooks_of_both_outputs_see_their_gradients() -> None:
    # Ported from test_hook_none: both outputs used, both hooks see a gradient.
    seen: list[Variable | None] = []
    rx, ry = NoneGradient.apply(Variable(2.0, requires_grad=True), Variable(3.0))
    rx.register_hook(seen.append)
    ry.register_hook(seen.append)
    await Add.apply(rx, ry).backward()
    assert [g.data if g is not None else None for g in seen] == [1.0, 1.0]


@pytest.mark.anyio
async def test_a_hook_on_an_output_that_got_no_gradient_sees_none_when_a_sibling_did() -> None:
    """PyTorch calls a tensor hook whenever its node runs, with None for an output no
    gradient reached (PyFunctionTensorPreHook wraps the undefined gradient as None); a
    retained output stays None; a value the hook returns becomes that output's gradient."""
    seen: list[tuple[str, Any]] = []
    x = Variable(0.5, requires_grad=True)
    s, c = SinCos.apply(x)
    s.register_hook(lambda g: seen.append(("sin", g.data)))
    c.register_hook(lambda g: seen.append(("cos", g)))
    c.retain_grad()
    await Mul.apply(s, Variable(2.0)).backward()
    assert seen == [("sin", 2.0), ("cos", None)]
    assert c.grad is None and x.grad is not None
    assert x.grad.data == pytest.approx(2 * math.cos(0.5))

    # The hook may give the unused output a gradient of its own: backward receives it.
    x = Variable(0.5, requires_grad=True)
    s, c = SinCos.apply(x)
    c.register_hook(lambda g: Variable(1.0) if g is None else None)
    c.retain_grad()
    await Mul.apply(s, Variable(2.0)).backward()
    assert c.grad is not None and c.grad.data == 1.0
    assert x.grad is not None
    assert x.grad.data == pytest.approx(2 * math.cos(0.5) - math.sin(0.5))


@pytest.mark.anyio
async def test_hooks_of_a_node_that_got_no_gradient_at_all_are_not_called() -> None:
    class Block(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            return Variable(x.data)

        @staticmethod
        def backward(ctx: Any, g: Variable) -> None:
            return None

    seen: list[Any] = []
    s, c = SinCos.apply(Variable(0.5, requires_grad=True))
    s.register_hook(seen.append)
    c.register_hook(seen.append)
    await Block.apply(s).backward()
    assert seen == []
