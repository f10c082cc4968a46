"""Functions and a random-graph generator shared by the core tests.

``Identity`` and ``AsyncIdentity`` pass any data and gradient through (text, floats,
arrays): the node for tests about the engine rather than the math. The numeric ones
write every backward in terms of these Functions, so it is recorded under
``create_graph=True`` and can be differentiated again; ``Add`` works on any data with
a ``+``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from asyncgraph import Function, Variable, no_grad


class Identity(Function):
    """Copies its input's data forward and passes the gradient back (an inline node)."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


class AsyncIdentity(Function):
    """``Identity`` with an async backward: a node the engine runs as a task."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        return g


def _const(value: float) -> Variable:
    return Variable(float(value))


class Add(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable | None, Variable | None]:
        need_a, need_b = ctx.needs_input_grad
        return (g if need_a else None, g if need_b else None)


class Sub(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data - b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable | None, Variable | None]:
        need_a, need_b = ctx.needs_input_grad
        return (g if need_a else None, Neg.apply(g) if need_b else None)


class Neg(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        return Variable(-a.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return Neg.apply(g)


class Mul(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        ctx.save_for_backward(a, b)
        return Variable(a.data * b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable | None, Variable | None]:
        a, b = ctx.saved_variables
        need_a, need_b = ctx.needs_input_grad
        return (Mul.apply(g, b) if need_a else None, Mul.apply(g, a) if need_b else None)


class Sin(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        ctx.save_for_backward(a)
        return Variable(math.sin(a.data))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        (a,) = ctx.saved_variables
        return Mul.apply(g, Cos.apply(a))


class Cos(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        ctx.save_for_backward(a)
        return Variable(math.cos(a.data))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        (a,) = ctx.saved_variables
        return Neg.apply(Mul.apply(g, Sin.apply(a)))


class Exp(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        ctx.save_for_backward(a)
        return Variable(math.exp(a.data))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        (a,) = ctx.saved_variables
        return Mul.apply(g, Exp.apply(a))


class Tanh(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        ctx.save_for_backward(a)
        return Variable(math.tanh(a.data))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        (a,) = ctx.saved_variables
        t = Tanh.apply(a)
        return Mul.apply(g, Sub.apply(_const(1.0), Mul.apply(t, t)))


class Cube(Function):
    """x**3 as one node: its derivative has a single path (no engine summing)."""

    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        ctx.save_for_backward(a)
        return Variable(a.data**3)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        (a,) = ctx.saved_variables
        return Mul.apply(g, Mul.apply(_const(3.0), Mul.apply(a, a)))


class SinCos(Function):
    """Two outputs: (sin(a), cos(a))."""

    @staticmethod
    def forward(ctx: Any, a: Variable) -> tuple[Variable, Variable]:
        ctx.save_for_backward(a)
        return Variable(math.sin(a.data)), Variable(math.cos(a.data))

    @staticmethod
    def backward(ctx: Any, g_sin: Variable | None, g_cos: Variable | None) -> Variable | None:
        (a,) = ctx.saved_variables
        total: Variable | None = None
        if g_sin is not None:
            total = Mul.apply(g_sin, Cos.apply(a))
        if g_cos is not None:
            part = Neg.apply(Mul.apply(g_cos, Sin.apply(a)))
            total = part if total is None else Add.apply(total, part)
        return total


UNARY = {"neg": Neg, "sin": Sin, "cos": Cos, "exp": Exp, "tanh": Tanh, "cube": Cube}
BINARY = {"add": Add, "sub": Sub, "mul": Mul}
_PY = {
    "neg": lambda a: -a,
    "sin": math.sin,
    "cos": math.cos,
    "exp": math.exp,
    "tanh": math.tanh,
    "cube": lambda a: a**3,
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
}
_LIMIT = 4.0  # keep every value small so finite differences stay well conditioned


@dataclass
class GraphSpec:
    """A random DAG: ``ops[k] = (name, operand indices)``; value ``i`` is input
    ``i`` for ``i < num_inputs`` and op ``i - num_inputs`` after that.
    ``sincos`` ops produce two values (sin, then cos)."""

    seed: int
    inputs: list[float]
    ops: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    output_weights: list[float] = field(default_factory=list)

    def reachable_inputs(self) -> set[int]:
        """Indices of the inputs that some output depends on."""
        producers: dict[int, tuple[int, ...]] = {}
        index = len(self.inputs)
        for name, operands in self.ops:
            width = 2 if name == "sincos" else 1
            for _ in range(width):
                producers[index] = operands
                index += 1
        seen: set[int] = set()
        stack = list(self.outputs)
        while stack:
            value = stack.pop()
            if value in seen:
                continue
            seen.add(value)
            stack.extend(producers.get(value, ()))
        return {i for i in seen if i < len(self.inputs)}


def random_graph(seed: int) -> GraphSpec:
    """A small random DAG (5-20 ops) with shared subexpressions, a multi-output
    op, 1-3 outputs and an input that nothing uses (the last one)."""
    rng = random.Random(seed)
    num_used = rng.randint(1, 4)
    inputs = [round(rng.uniform(-1.0, 1.0), 3) for _ in range(num_used + 1)]
    spec = GraphSpec(seed, inputs)
    unused = num_used
    values = list(inputs)  # the float of every value, in the spec's numbering

    def pick() -> int:
        # Bias operands toward recent values (deep graphs); older values get
        # reused too (shared subexpressions). Never the unused input.
        while True:
            i = len(values) - 1 - min(int(rng.expovariate(0.5)), len(values) - 1)
            if i != unused:
                return i

    for _ in range(rng.randint(5, 20)):
        kind = rng.random()
        if kind < 0.45:
            name = rng.choice(sorted(BINARY))
            operands: tuple[int, ...] = (pick(), pick())
        elif kind < 0.55:
            name = "sincos"
            operands = (pick(),)
        else:
            name = rng.choice(sorted(UNARY))
            operands = (pick(),)
        if name == "sincos":
            x = values[operands[0]]
            spec.ops.append((name, operands))
            values.extend([math.sin(x), math.cos(x)])
            continue
        result = _PY[name](*(values[i] for i in operands))
        if abs(result) > _LIMIT:
            name, operands = "tanh", operands[:1]
            result = math.tanh(values[operands[0]])
        spec.ops.append((name, operands))
        values.append(result)
    candidates = list(range(len(inputs), len(values)))
    spec.outputs = rng.sample(candidates, rng.randint(1, min(3, len(candidates))))
    spec.output_weights = [round(rng.uniform(-2.0, 2.0), 3) for _ in spec.outputs]
    return spec


def build(
    spec: GraphSpec, inputs: list[float] | None = None, *, requires_grad: bool = True
) -> tuple[list[Variable], list[Variable], list[Variable]]:
    """Apply the spec's Functions to fresh leaves; return (leaves, all values, outputs)."""
    xs = spec.inputs if inputs is None else inputs
    leaves = [
        Variable(float(x), role=f"x{i}", requires_grad=requires_grad) for i, x in enumerate(xs)
    ]
    values: list[Variable] = list(leaves)
    for name, operands in spec.ops:
        args = [values[i] for i in operands]
        if name == "sincos":
            s, c = SinCos.apply(*args)
            values.extend([s, c])
        else:
            fn = BINARY.get(name) or UNARY[name]
            values.append(fn.apply(*args))
    return leaves, values, [values[i] for i in spec.outputs]


def weighted_output(spec: GraphSpec, inputs: list[float]) -> float:
    """sum_k w_k * output_k, evaluated without recording."""
    with no_grad():
        _, _, outs = build(spec, inputs, requires_grad=False)
    return sum(w * o.data for w, o in zip(spec.output_weights, outs, strict=True))


def central_difference(f: Any, xs: list[float], i: int, h: float = 1e-6) -> float:
    """(f(x + h e_i) - f(x - h e_i)) / 2h."""
    up = list(xs)
    down = list(xs)
    up[i] += h
    down[i] -= h
    return float((f(up) - f(down)) / (2 * h))


def assert_close(actual: float, expected: float, *, rtol: float, atol: float, what: str) -> None:
    assert math.isfinite(actual), what
    assert abs(actual - expected) <= atol + rtol * abs(expected), (
        f"{what}: got {actual!r}, expected {expected!r}"
    )
