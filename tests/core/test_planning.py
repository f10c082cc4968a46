"""Planning a pass is a pure function of the graph (no event loop, nothing runs)."""

from __future__ import annotations

import pytest

from asyncgraph import GraphError, Parameter, Variable
from asyncgraph._core._planning import make_plan

from ._ops import Add, Mul, Sin


def root(y: Variable) -> list:
    assert y.grad_fn is not None
    return [((y.grad_fn, y.output_nr), Variable(1.0))]


def test_every_target_waits_for_as_many_gradients_as_edges_reach_it() -> None:
    a, b = Parameter(1.0), Parameter(2.0)
    s = Add.apply(a, b)
    y = Mul.apply(s, Sin.apply(s))  # s is used twice
    plan = make_plan(root(y), None, ())
    assert plan.execute is None and plan.receives is None  # everything reached runs
    assert plan.pending[y.grad_fn] == 1
    assert plan.pending[s.grad_fn] == 2
    assert plan.pending[a] == 1 and plan.pending[b] == 1


def test_a_capture_runs_only_the_nodes_leading_to_it() -> None:
    a, b = Parameter(1.0), Parameter(2.0)
    left, right = Sin.apply(a), Sin.apply(b)
    y = Add.apply(left, right)
    plan = make_plan(root(y), [a], ())
    assert plan.execute == {y.grad_fn, left.grad_fn}  # right's branch leads nowhere wanted
    assert plan.receives is not None and a in plan.receives and b not in plan.receives


def test_planning_through_a_freed_graph_says_how_to_keep_it() -> None:
    a = Parameter(1.0)
    y = Sin.apply(a)
    assert y.grad_fn is not None
    y.grad_fn.release()
    with pytest.raises(GraphError, match="retain_graph=True"):
        make_plan(root(y), None, ())
