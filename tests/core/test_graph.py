"""The recorded graph as a user walks it: ``grad_fn.next_functions``."""

from __future__ import annotations

from asyncgraph import Node, Variable, no_grad
from asyncgraph._core._graph import AccumulateGrad

from ._ops import Add, Mul, SinCos


def graph_desc(fn: Node | AccumulateGrad | None) -> str:
    """PyTorch's graph_desc (test_autograd.py), on asyncgraph's names."""
    if fn is None:
        return "None"
    inner = ", ".join(graph_desc(next_fn) for next_fn, _ in fn.next_functions)
    return f"{fn.name}({inner})"


def test_next_functions_walks_the_graph_as_pytorch_does() -> None:
    x = Variable(2.0, role="x", requires_grad=True)
    w = Variable(3.0, role="w", requires_grad=True)
    y = Add.apply(Mul.apply(x, w), Variable(1.0))
    assert graph_desc(y.grad_fn) == "Add(Mul(AccumulateGrad(), AccumulateGrad()), None)"
    assert y.grad_fn is not None
    (mul, mul_nr), (none, none_nr) = y.grad_fn.next_functions
    assert isinstance(mul, Node) and mul is y.grad_fn.next_edges[0][0]  # type: ignore[index]
    assert (mul_nr, none, none_nr) == (0, None, 0)
    (acc_x, nr_x), (acc_w, nr_w) = mul.next_functions
    assert isinstance(acc_x, AccumulateGrad) and acc_x.variable is x and nr_x == 0
    assert isinstance(acc_w, AccumulateGrad) and acc_w.variable is w and nr_w == 0
    assert acc_x.next_functions == ()


def test_next_functions_names_the_output_of_a_multi_output_node() -> None:
    x = Variable(0.5, requires_grad=True)
    s, c = SinCos.apply(x)
    z = Add.apply(c, s)
    assert z.grad_fn is not None and s.grad_fn is not None
    assert z.grad_fn.next_functions == ((s.grad_fn, 1), (s.grad_fn, 0))


def test_the_accumulate_grad_of_one_leaf_is_equal_wherever_it_is_reached() -> None:
    x = Variable(1.0, requires_grad=True)
    a, b = Mul.apply(x, x), Add.apply(x, Variable(1.0))
    assert a.grad_fn is not None and b.grad_fn is not None
    assert a.grad_fn.next_functions[0][0] == b.grad_fn.next_functions[0][0]
    assert a.grad_fn.next_functions[0][0] == a.grad_fn.next_functions[1][0]
    assert len({a.grad_fn.next_functions[0][0], b.grad_fn.next_functions[0][0]}) == 1
    other = Mul.apply(Variable(1.0, requires_grad=True), Variable(1.0))
    assert other.grad_fn is not None
    assert other.grad_fn.next_functions[0][0] != a.grad_fn.next_functions[0][0]


def test_an_output_made_under_no_grad_has_no_node_to_walk() -> None:
    with no_grad():
        y = Mul.apply(Variable(1.0, requires_grad=True), Variable(2.0))
    assert y.grad_fn is None
