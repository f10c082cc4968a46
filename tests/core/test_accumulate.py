"""Gradient accumulation by type, in graph order, deterministic under any scheduling."""

from __future__ import annotations

import random
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest

from asyncgraph import Function, LocalExecutor, Parameter, Variable, backward, register_accumulator
from asyncgraph._core._accumulate import accumulate

from ._ops import Identity, Mul

# -- accumulate() -------------------------------------------------------------------


def test_numbers_add() -> None:
    assert accumulate(1, 2) == 3
    assert accumulate(0.5, 0.25) == 0.75
    assert accumulate(1, 0.5) == 1.5


def test_numpy_arrays_add() -> None:
    a = np.array([1.0, 2.0])
    b = np.array([10.0, 20.0])
    result = accumulate(a, b)
    np.testing.assert_array_equal(result, np.array([11.0, 22.0]))
    np.testing.assert_array_equal(a, np.array([1.0, 2.0]))  # inputs untouched
    np.testing.assert_array_equal(accumulate(1.0, a), np.array([2.0, 3.0]))
    assert accumulate(np.float64(1.5), np.float64(2.0)) == 3.5


def test_text_accumulates_into_a_list_in_order() -> None:
    assert accumulate("a", "b") == ["a", "b"]
    assert accumulate(["a"], "b") == ["a", "b"]
    assert accumulate("a", ["b", "c"]) == ["a", "b", "c"]
    assert accumulate(["a", "b"], ["c", "d"]) == ["a", "b", "c", "d"]


def test_text_accumulation_does_not_modify_its_arguments() -> None:
    left = ["a"]
    right = ["b"]
    assert accumulate(left, right) == ["a", "b"]
    assert left == ["a"] and right == ["b"]


def test_unregistered_types_raise_pointing_to_register_accumulator() -> None:
    with pytest.raises(TypeError, match="register_accumulator"):
        accumulate({"a": 1}, {"b": 2})


class Vec(tuple):  # type: ignore[type-arg]
    """A custom gradient type (a tuple subclass, so it is valid Variable data)."""


def _vec_add(a: Vec, b: Vec) -> Vec:
    return Vec(x + y for x, y in zip(a, b, strict=True))


def test_register_accumulator_for_a_custom_type() -> None:
    register_accumulator(Vec, _vec_add)
    assert accumulate(Vec((1, 2)), Vec((10, 20))) == Vec((11, 22))


def test_register_accumulator_validates_its_arguments() -> None:
    with pytest.raises(TypeError, match="type"):
        register_accumulator("Vec", _vec_add)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        register_accumulator(Vec, "add")  # type: ignore[arg-type]


class Fork(Function):
    """Uses its input twice; the backward sends each copy its own gradient."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
        return Variable(x.data), Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g1: Variable | None, g2: Variable | None) -> Any:
        present = [g for g in (g1, g2) if g is not None]
        total = present[0].data
        for g in present[1:]:
            total = accumulate(total, g.data)
        return total


@pytest.mark.anyio
async def test_registered_accumulator_sums_gradients_in_the_engine() -> None:
    register_accumulator(Vec, _vec_add)
    x = Variable(Vec((0, 0)), requires_grad=True)
    a = Identity.apply(x)
    b = Identity.apply(x)
    await backward([a, b], [Vec((1, 2)), Vec((10, 20))])
    assert x.grad is not None and x.grad.data == Vec((11, 22))


# -- graph order, not completion order ------------------------------------------------


class First(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(f"first({x.data})")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> str:
        await ctx.second_done.wait()  # finish after Second, although created before it
        return f"from first: {g.data}"


class Second(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(f"second({x.data})")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> str:
        ctx.second_done.set()
        return f"from second: {g.data}"


class Join(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(f"{a.data} | {b.data}")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[str, str]:
        return f"left of {g.data}", f"right of {g.data}"


@pytest.mark.anyio
async def test_text_gradients_accumulate_in_graph_order_not_completion_order() -> None:
    x = Parameter("draft", role="draft")
    x.grad = Variable("earlier feedback")
    a = First.apply(x)
    b = Second.apply(x)
    done = anyio.Event()
    assert a.grad_fn is not None and b.grad_fn is not None
    a.grad_fn.ctx.second_done = done  # type: ignore[attr-defined]
    b.grad_fn.ctx.second_done = done  # type: ignore[attr-defined]
    y = Join.apply(a, b)
    with anyio.fail_after(10):  # a deadlock guard, not a timing assertion
        await y.backward("too long")
    assert x.grad.data == [
        "earlier feedback",
        "from first: left of too long",
        "from second: right of too long",
    ]


@pytest.mark.anyio
async def test_one_consumer_using_an_input_twice_accumulates_by_input_position() -> None:
    x = Parameter("draft")
    y = Join.apply(x, x)
    await y.backward("fb")
    assert x.grad is not None and x.grad.data == ["left of fb", "right of fb"]


@pytest.mark.anyio
async def test_existing_grad_comes_first_then_the_new_gradient() -> None:
    x = Parameter(np.array([1.0, 1.0]))
    x.grad = Variable(np.array([5.0, 5.0]))
    y = Identity.apply(x)
    await y.backward(np.array([1.0, 2.0]))
    np.testing.assert_array_equal(x.grad.data, np.array([6.0, 7.0]))


# -- determinism under random delays -------------------------------------------------


async def _delay(ctx: Any) -> None:
    await anyio.sleep(getattr(ctx, "delay_s", 0.0))


def _text(g: Variable) -> str:
    return g.data if isinstance(g.data, str) else " + ".join(g.data)


class Critique(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(f"critique({x.data})")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> str:
        await _delay(ctx)
        return f"critique<{_text(g)}>"


class Combine(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(f"{a.data}&{b.data}")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[str, str]:
        await _delay(ctx)
        return f"left<{_text(g)}>", f"right<{_text(g)}>"


class Score(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(len(x.data) / 7.0)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> str:
        await _delay(ctx)
        return f"score<{g.data!r}>"


class AMul(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        ctx.save_for_backward(a, b)
        return Variable(a.data * b.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[float, float]:
        await _delay(ctx)
        a, b = ctx.saved_variables
        return g.data * b.data, g.data * a.data


class AAdd(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[float, float]:
        await _delay(ctx)
        return g.data, g.data


def _build(delays: random.Random | None) -> tuple[list[Variable], list[Variable], list[Any]]:
    """Text and numbers, shared subexpressions, three roots; a 0-5 ms delay per node."""
    p = Parameter("prompt", role="prompt")
    c = Variable("context", role="context", requires_grad=True)
    w1 = Parameter(0.1, role="w1")
    w2 = Parameter(0.7, role="w2")
    d1 = Critique.apply(p)
    d2 = Combine.apply(p, c)
    d3 = Combine.apply(d1, d2)
    d4 = Combine.apply(d3, d1)
    s1, s2, s3 = Score.apply(d3), Score.apply(d1), Score.apply(d4)
    n1 = AMul.apply(s1, w1)
    n2 = AMul.apply(s2, w2)
    n3 = AAdd.apply(n1, n2)
    n4 = AMul.apply(n3, w1)
    n5 = AMul.apply(s3, n3)
    sq = Mul.apply(n3, n3)  # a synchronous node: runs inline, between the async ones
    n6 = AAdd.apply(n5, Mul.apply(sq, w2))
    for v in (d1, d2, d3, d4, s1, s2, s3, n1, n2, n3, n4, n5, n6):
        assert v.grad_fn is not None
        v.grad_fn.ctx.delay_s = 0.0 if delays is None else delays.uniform(0.0, 0.005)  # type: ignore[attr-defined]
    return [p, c, w1, w2], [n4, n6, d4], [1.0, 0.3, "be concise"]


async def _run(seed: int | None, executor: LocalExecutor | None = None) -> bytes:
    leaves, roots, grads = _build(None if seed is None else random.Random(seed))
    await backward(roots, grads, executor=executor)
    data = [leaf.grad.data if leaf.grad is not None else None for leaf in leaves]
    return msgpack.packb(data) + repr(data).encode()


@pytest.mark.anyio
async def test_gradients_are_identical_whatever_the_completion_order() -> None:
    reference = await _run(None, LocalExecutor(max_concurrency=1))
    results = {seed: await _run(seed) for seed in range(12)}
    results[-1] = await _run(99, LocalExecutor(max_concurrency=1))
    for seed, result in results.items():
        assert result == reference, f"run with delay seed {seed} differs"
    # the text gradient of the prompt gathers every path's feedback, in graph order
    leaves, roots, grads = _build(None)
    await backward(roots, grads)
    prompt_grad = leaves[0].grad
    assert prompt_grad is not None and isinstance(prompt_grad.data, list)
    assert len(prompt_grad.data) == 2  # from Critique(p) and from Combine(p, c)
    assert prompt_grad.data[1].startswith("left<")  # p is Combine's left input
