"""Post-accumulate-grad hooks: once per pass, in the pass, with that pass's gradient."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Function, Variable, grad
from asyncgraph._core._graph import RemovableHandle

from ._ops import Add, Mul

pytestmark = pytest.mark.anyio


class Gate(Function):
    """Identity whose backward waits for ``gate`` (an anyio Event) before returning."""

    @staticmethod
    def forward(ctx: Any, a: Variable, gate: Any) -> Variable:
        ctx.gate = gate
        return Variable(a.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        await ctx.gate.wait()
        return g, None


class Boom(Function):
    """Identity whose backward fails once ``after`` (an anyio Event) is set."""

    @staticmethod
    def forward(ctx: Any, a: Variable, after: Any) -> Variable:
        ctx.after = after
        return Variable(a.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        await ctx.after.wait()
        raise RuntimeError("boom")


async def test_fires_once_with_the_summed_gradient_before_commit() -> None:
    x = Variable(3.0, role="x", requires_grad=True)
    seen: list[tuple[Variable, float, Variable | None]] = []

    def hook(leaf: Variable, g: Variable) -> None:
        seen.append((leaf, g.data, leaf.grad))

    handle = x.register_post_accumulate_grad_hook(hook)
    assert isinstance(handle, RemovableHandle)
    await Add.apply(Mul.apply(x, x), x).backward()  # d/dx (x*x + x) = 2x + 1
    assert seen == [(x, 7.0, None)]  # one call, the sum; .grad not yet written
    assert x.grad is not None and x.grad.data == 7.0


async def test_receives_this_pass_gradient_and_commit_adds_it() -> None:
    x = Variable(2.0, requires_grad=True)
    got: list[float] = []
    x.register_post_accumulate_grad_hook(lambda leaf, g: got.append(g.data))
    await Mul.apply(x, Variable(5.0)).backward()
    await Mul.apply(x, Variable(5.0)).backward()
    assert got == [5.0, 5.0]  # each pass's own gradient
    assert x.grad is not None and x.grad.data == 10.0  # accumulated across passes


async def test_runs_after_gradient_hooks_and_sees_their_result() -> None:
    x = Variable(2.0, requires_grad=True)
    order: list[str] = []

    def grad_hook(g: Variable) -> Variable:
        order.append("hook")
        return Variable(g.data * 10)

    def post(leaf: Variable, g: Variable) -> None:
        order.append(f"post {g.data}")

    x.register_post_accumulate_grad_hook(post)
    x.register_hook(grad_hook)
    await Mul.apply(x, Variable(3.0)).backward()
    assert order == ["hook", "post 30.0"]


async def test_fires_while_the_rest_of_the_pass_still_runs() -> None:
    # y's branch cannot finish until x's hook opens the gate: the pass completes only
    # if x's hook runs before the whole backward is over.
    x = Variable(1.0, role="x", requires_grad=True)
    y = Variable(2.0, role="y", requires_grad=True)
    gate = anyio.Event()
    y_hooked: list[float] = []

    async def open_gate(leaf: Variable, g: Variable) -> None:
        await anyio.lowlevel.checkpoint()
        gate.set()

    x.register_post_accumulate_grad_hook(open_gate)
    y.register_post_accumulate_grad_hook(lambda leaf, g: y_hooked.append(g.data))
    loss = Add.apply(x, Gate.apply(y, gate))
    with anyio.fail_after(60):
        await loss.backward()
    assert gate.is_set() and y_hooked == [1.0]
    assert x.grad is not None and y.grad is not None


async def test_a_failed_pass_commits_nothing_and_cancels_running_hooks() -> None:
    x = Variable(1.0, role="x", requires_grad=True)
    y = Variable(2.0, role="y", requires_grad=True)
    started = anyio.Event()
    finished: list[str] = []

    async def slow(leaf: Variable, g: Variable) -> None:
        started.set()
        await anyio.sleep(10)
        finished.append("x")

    x.register_post_accumulate_grad_hook(slow)
    loss = Add.apply(x, Boom.apply(y, started))
    with anyio.fail_after(60), pytest.raises(BackwardError, match="boom"):
        await loss.backward()
    assert finished == []  # cancelled with the pass
    assert x.grad is None and y.grad is None


async def test_a_raising_hook_fails_the_pass() -> None:
    x = Variable(1.0, role="x", requires_grad=True)

    def bad(leaf: Variable, g: Variable) -> None:
        raise ValueError("nope")

    x.register_post_accumulate_grad_hook(bad)
    with pytest.raises(BackwardError, match=r"post-accumulate-grad hook .* raised ValueError"):
        await Mul.apply(x, Variable(2.0)).backward()
    assert x.grad is None


async def test_a_hook_returning_a_value_fails_the_pass() -> None:
    x = Variable(1.0, role="x", requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda leaf, g: Variable(0.0))
    with pytest.raises(BackwardError, match="must return None"):
        await Mul.apply(x, Variable(2.0)).backward()
    assert x.grad is None


async def test_not_fired_by_grad_nor_without_a_gradient_nor_after_remove() -> None:
    x = Variable(1.0, requires_grad=True)
    z = Variable(1.0, requires_grad=True)
    calls: list[str] = []
    handle = x.register_post_accumulate_grad_hook(lambda leaf, g: calls.append("x"))
    z.register_post_accumulate_grad_hook(lambda leaf, g: calls.append("z"))
    (gx,) = await grad(Mul.apply(x, Variable(2.0)), [x])
    assert gx is not None and gx.data == 2.0 and calls == []  # grad() does not accumulate
    await Mul.apply(x, Variable(2.0)).backward(inputs=[x])  # z is not reached
    assert calls == ["x"]
    handle.remove()
    await Mul.apply(x, Variable(2.0)).backward()
    assert calls == ["x"]


def test_only_leaves_that_require_grad_take_one() -> None:
    x = Variable(1.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="only be registered on leaves"):
        Mul.apply(x, x).register_post_accumulate_grad_hook(lambda leaf, g: None)
    with pytest.raises(RuntimeError, match="does not require grad"):
        Variable(1.0).register_post_accumulate_grad_hook(lambda leaf, g: None)
