"""Numeric gradients against central finite differences on random DAGs."""

from __future__ import annotations

import pytest

import asyncgraph
from asyncgraph import Variable

from ._ops import (
    GraphSpec,
    assert_close,
    build,
    central_difference,
    random_graph,
    weighted_output,
)

SEEDS = range(300)


def _expected_first_order(spec: GraphSpec) -> list[float]:
    return [
        central_difference(lambda xs: weighted_output(spec, xs), spec.inputs, i)
        for i in range(len(spec.inputs))
    ]


def _check(spec: GraphSpec, got: list[Variable | None], expected: list[float]) -> None:
    reachable = spec.reachable_inputs()
    for i, (g, fd) in enumerate(zip(got, expected, strict=True)):
        what = f"seed {spec.seed}, d/dx{i}, spec {spec}"
        if i not in reachable:
            assert g is None, what
            assert abs(fd) < 1e-9, what
        else:
            assert g is not None, what
            assert_close(g.data, fd, rtol=1e-5, atol=1e-6, what=what)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", SEEDS)
async def test_random_dag_gradients_match_finite_differences(seed: int) -> None:
    spec = random_graph(seed)
    leaves, _, outputs = build(spec)
    expected = _expected_first_order(spec)
    if seed % 2 == 0:
        got = await asyncgraph.grad(
            outputs, leaves, grad_outputs=tuple(spec.output_weights), allow_unused=True
        )
        _check(spec, list(got), expected)
        assert all(leaf.grad is None for leaf in leaves)
    else:
        await asyncgraph.backward(outputs, tuple(spec.output_weights))
        _check(spec, [leaf.grad for leaf in leaves], expected)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", SEEDS[::10])
async def test_random_dag_second_derivatives_match_finite_differences(seed: int) -> None:
    """create_graph=True: d/dx_j of (d out / d x_i), against differences of first derivatives."""
    spec = random_graph(seed)
    reachable = sorted(spec.reachable_inputs())
    if not reachable:
        pytest.skip("no input reaches the outputs")
    n = len(spec.inputs)

    async def first_derivative(xs: list[float], i: int) -> float:
        leaves, _, outputs = build(spec, xs)
        (g,) = await asyncgraph.grad(
            outputs, [leaves[i]], grad_outputs=tuple(spec.output_weights), allow_unused=True
        )
        return 0.0 if g is None else float(g.data)

    leaves, _, outputs = build(spec)
    firsts = await asyncgraph.grad(
        outputs,
        leaves,
        grad_outputs=tuple(spec.output_weights),
        create_graph=True,
        allow_unused=True,
    )
    for i in reachable:
        first = firsts[i]
        assert first is not None
        if first.requires_grad:
            seconds = await asyncgraph.grad(first, leaves, retain_graph=True, allow_unused=True)
        else:  # the derivative is a constant: nothing to differentiate
            seconds = (None,) * n
        for j in range(n):
            h = 1e-5
            up = list(spec.inputs)
            down = list(spec.inputs)
            up[j] += h
            down[j] -= h
            fd = (await first_derivative(up, i) - await first_derivative(down, i)) / (2 * h)
            second = seconds[j]
            got = 0.0 if second is None else float(second.data)
            assert_close(
                got, fd, rtol=1e-4, atol=1e-5, what=f"seed {seed}, d2/dx{i}dx{j}, spec {spec}"
            )
