"""backward() and grad(): PyTorch semantics, retain_graph, inputs, create_graph."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import pytest

import asyncgraph
from asyncgraph import Function, GraphError, Variable, backward, grad

from ._ops import Add, Cube, Exp, Identity, Mul, Sin, SinCos, assert_close, central_difference

# -- implicit gradients -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("data", "implicit"),
    [(3, 1), (2.5, 1.0), ("an answer", "")],
    ids=["int", "float", "str"],
)
async def test_implicit_grad_of_a_scalar_output(data: Any, implicit: Any) -> None:
    x = Variable(data, requires_grad=True)
    await backward(Identity.apply(x))
    assert x.grad is not None
    assert x.grad.data == implicit
    assert type(x.grad.data) is type(implicit)


@pytest.mark.anyio
async def test_implicit_grad_of_a_one_element_array_is_ones() -> None:
    x = Variable(np.array([4.0]), requires_grad=True)
    await backward(Identity.apply(x))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.data, np.ones(1))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "data",
    [["a", "b"], [1.0, 2.0], {"k": 1}, np.zeros(3), True, None],
    ids=["list_str", "list_num", "dict", "array", "bool", "none"],
)
async def test_implicit_grad_of_a_non_scalar_output_raises(data: Any) -> None:
    y = Identity.apply(Variable(data, requires_grad=True))
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        await backward(y)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        await grad(y, y)


@pytest.mark.anyio
async def test_explicit_grad_for_non_scalar_outputs() -> None:
    x = Variable(["a", "b"], requires_grad=True)
    await backward(Identity.apply(x), ["fix a", "fix b"])
    assert x.grad is not None and x.grad.data == ["fix a", "fix b"]

    arr = Variable(np.arange(3.0), requires_grad=True)
    await backward(Identity.apply(arr), np.full(3, 2.0))
    assert arr.grad is not None
    np.testing.assert_array_equal(arr.grad.data, np.full(3, 2.0))


@pytest.mark.anyio
async def test_backward_of_several_roots_with_given_grads() -> None:
    x = Variable(2.0, requires_grad=True)
    a = Mul.apply(x, x)
    b = Mul.apply(x, Variable(3.0))
    await backward([a, b], [Variable(1.0), 10.0])
    assert x.grad is not None and x.grad.data == 4.0 + 30.0


@pytest.mark.anyio
async def test_backward_grad_count_mismatch_raises() -> None:
    x = Variable(2.0, requires_grad=True)
    # A RuntimeError, as PyTorch's "got 2 tensors and 1 gradients".
    with pytest.raises(RuntimeError, match=r"got 2 variables and 1 gradients.*one gradient"):
        await backward([Mul.apply(x, x), Mul.apply(x, x)], (1.0,))


@pytest.mark.anyio
async def test_backward_of_output_without_history_raises() -> None:
    y = Mul.apply(Variable(1.0), Variable(2.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        await backward(y)


# -- retain_graph -------------------------------------------------------------


@pytest.mark.anyio
async def test_second_backward_without_retain_graph_raises() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(Sin.apply(x), x)
    await y.backward()
    with pytest.raises(RuntimeError, match=r"retain_graph=True") as info:
        await y.backward()
    assert "second time" in str(info.value)
    with pytest.raises(RuntimeError, match=r"retain_graph=True"):
        await grad(y, x)


@pytest.mark.anyio
async def test_saved_variables_are_freed_after_backward_without_retain_graph() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    assert y.grad_fn is not None
    ctx = y.grad_fn.ctx
    await y.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        _ = ctx.saved_variables


@pytest.mark.anyio
async def test_second_backward_with_retain_graph_works_and_accumulates() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    await y.backward(retain_graph=True)
    assert x.grad is not None and x.grad.data == 4.0
    await y.backward(retain_graph=True)
    assert x.grad.data == 8.0
    await y.backward()  # the last one may free
    assert x.grad.data == 12.0
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        await y.backward()


@pytest.mark.anyio
async def test_a_second_backward_through_nodes_that_saved_nothing_works() -> None:
    """PyTorch's test_backward_twice_without_saved_values: only saved variables are freed."""
    x = Variable(np.zeros(3), requires_grad=True)
    y = Add.apply(x, Variable(np.ones(3)))
    await y.backward(np.ones(3))
    await y.backward(np.ones(3))  # Add saved nothing: nothing was freed
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.data, np.full(3, 2.0))


@pytest.mark.anyio
async def test_a_grad_is_never_the_callers_gradient_or_another_leafs() -> None:
    """As PyTorch clones a gradient it cannot steal: changing one .grad in place changes
    neither the gradient given to backward nor another leaf's .grad."""
    x, w = Variable(np.ones(3), requires_grad=True), Variable(np.ones(3), requires_grad=True)
    g = Variable(np.ones(3))
    await Add.apply(x, w).backward(g)
    assert x.grad is not None and w.grad is not None
    assert x.grad is not w.grad and x.grad is not g and x.grad.data is not w.grad.data
    x.grad.data *= 0
    np.testing.assert_array_equal(w.grad.data, np.ones(3))
    np.testing.assert_array_equal(g.data, np.ones(3))


@pytest.mark.anyio
async def test_accumulation_is_in_place_without_create_graph_and_out_of_place_with() -> None:
    """PyTorch's test_accumulate_grad: a reference to x.grad taken between two backwards
    sees the sum, unless the second records a graph (then .grad is a new Variable)."""

    async def compute_grad(create_graph: bool) -> tuple[Variable, np.ndarray]:
        x = Variable(np.ones(5), requires_grad=True)
        y = Add.apply(x, Variable(np.full(5, 2.0)))
        await y.backward(np.ones(5), retain_graph=True)
        assert x.grad is not None
        x_grad, x_grad_clone = x.grad, x.grad.data.copy()
        await y.backward(np.ones(5), create_graph=create_graph)
        return x_grad, x_grad_clone

    x_grad, clone = await compute_grad(create_graph=False)
    np.testing.assert_array_equal(x_grad.data, clone * 2)
    x_grad, clone = await compute_grad(create_graph=True)
    np.testing.assert_array_equal(x_grad.data, clone)


@pytest.mark.anyio
async def test_grad_materialize_grads_gives_zeros_for_unused_inputs() -> None:
    """PyTorch's autograd.grad(materialize_grads=True): implies allow_unused, and an
    unused input gets a zero like its data (text, which has no zero, gets None)."""
    x = Variable(2.0, requires_grad=True)
    unused = Variable(np.ones((2, 3), dtype=np.float32), requires_grad=True)
    text = Variable("t", requires_grad=True)
    y = Mul.apply(x, x)
    dx, du, dt = await grad(y, [x, unused, text], materialize_grads=True)
    assert dx is not None and dx.data == 4.0 and dt is None
    assert du is not None and du.data.shape == (2, 3) and du.data.dtype == np.float32
    assert not du.data.any()
    with pytest.raises(ValueError, match="materialize_grads=True needs allow_unused=True"):
        await grad(y, [x], materialize_grads=True, allow_unused=False)


@pytest.mark.anyio
async def test_retain_graph_defaults_to_create_graph() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    await y.backward(create_graph=True)
    await y.backward()  # graph was kept by create_graph=True
    assert x.grad is not None and x.grad.data == 8.0


# -- inputs ---------------------------------------------------------------------


class Counting(Function):
    calls: ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        Counting.calls.append("ran")
        return g


@pytest.mark.anyio
async def test_backward_inputs_restricts_accumulation_to_those_leaves() -> None:
    Counting.calls.clear()
    x = Variable(2.0, role="x", requires_grad=True)
    w = Variable(3.0, role="w", requires_grad=True)
    y = Add.apply(Mul.apply(x, w), Counting.apply(w))
    await backward(y, inputs=[x])
    assert x.grad is not None and x.grad.data == 3.0
    assert w.grad is None
    assert Counting.calls == []  # a node that leads only to w never runs


@pytest.mark.anyio
async def test_backward_inputs_may_be_non_leaves_whose_grad_is_filled() -> None:
    """PyTorch's test_backward_with_nonleaf_inputs (>= 1.10): a non-leaf among ``inputs``
    gets its gradient in ``.grad``; what lies behind it is not accumulated into."""
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)  # 4
    y = Mul.apply(h, h)  # 16: dy/dh = 2h = 8, dy/dx = 8 * 2x = 32
    await backward(y, inputs=[h], retain_graph=True)
    assert h.grad is not None and h.grad.data == 8.0 and x.grad is None
    await backward(y, inputs=[x, h])
    assert x.grad is not None and x.grad.data == 32.0
    assert h.grad.data == 16.0  # accumulated


@pytest.mark.anyio
async def test_backward_inputs_must_require_grad_and_be_non_empty() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        await backward(y, inputs=[Variable(1.0)])
    with pytest.raises(RuntimeError, match="empty"):
        await backward(y, inputs=[])


# -- grad() ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_grad_returns_gradients_and_does_not_touch_dot_grad() -> None:
    x = Variable(2.0, requires_grad=True)
    w = Variable(3.0, requires_grad=True)
    w.grad = Variable(100.0)
    y = Mul.apply(x, w)
    gx, gw = await grad(y, [x, w])
    assert isinstance(gx, Variable) and gx.data == 3.0
    assert isinstance(gw, Variable) and gw.data == 2.0
    assert x.grad is None
    assert w.grad.data == 100.0


@pytest.mark.anyio
async def test_grad_accepts_intermediate_variables() -> None:
    x = Variable(2.0, requires_grad=True)
    h = Mul.apply(x, x)  # 4
    y = Add.apply(Mul.apply(h, h), h)  # h**2 + h
    gh, gx = await grad(y, [h, x])
    assert gh is not None and gh.data == 2 * 4.0 + 1
    assert gx is not None and gx.data == (2 * 4.0 + 1) * 2 * 2.0
    assert h.grad is None and x.grad is None


@pytest.mark.anyio
async def test_grad_with_respect_to_the_output_itself() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    (gy,) = await grad(y, y, grad_outputs=5.0)
    assert gy is not None and gy.data == 5.0


@pytest.mark.anyio
async def test_grad_of_unused_input_raises_unless_allow_unused() -> None:
    x = Variable(2.0, requires_grad=True)
    unused = Variable(1.0, role="unused", requires_grad=True)
    y = Mul.apply(x, x)
    with pytest.raises(RuntimeError, match="allow_unused=True"):
        await grad(y, [x, unused], retain_graph=True)
    gx, gu = await grad(y, [x, unused], allow_unused=True)
    assert gx is not None and gx.data == 4.0
    assert gu is None


@pytest.mark.anyio
async def test_grad_input_that_does_not_require_grad_raises() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    with pytest.raises(RuntimeError, match="does not require grad"):
        await grad(y, [Variable(1.0)])


@pytest.mark.anyio
async def test_grad_with_grad_outputs_for_several_outputs() -> None:
    x = Variable(0.5, requires_grad=True)
    s, c = SinCos.apply(x)
    (gx,) = await grad([s, c], [x], grad_outputs=[2.0, 3.0])
    assert gx is not None
    assert gx.data == pytest.approx(2.0 * math.cos(0.5) - 3.0 * math.sin(0.5))


@pytest.mark.anyio
async def test_grad_without_create_graph_returns_gradients_without_history() -> None:
    x = Variable(2.0, requires_grad=True)
    (gx,) = await grad(Mul.apply(x, x), x)
    assert gx is not None and not gx.requires_grad and gx.is_leaf


# -- create_graph: higher order ---------------------------------------------------


@pytest.mark.anyio
async def test_second_and_third_derivative_of_cube_function() -> None:
    x = Variable(2.0, requires_grad=True)
    (g1,) = await grad(Cube.apply(x), x, create_graph=True)
    assert g1 is not None and g1.data == 12.0 and g1.requires_grad
    (g2,) = await grad(g1, x, create_graph=True)
    assert g2 is not None and g2.data == 12.0  # 6x
    (g3,) = await grad(g2, x)
    assert g3 is not None and g3.data == 6.0


@pytest.mark.anyio
async def test_second_derivative_of_x_cubed_built_from_products_sums_in_the_graph() -> None:
    """x*x*x uses x on three paths: the engine sums the incoming gradients, and
    under create_graph that sum is itself recorded, so d2/dx2 = 6x is right."""
    x = Variable(1.5, requires_grad=True)
    y = Mul.apply(Mul.apply(x, x), x)
    (g1,) = await grad(y, x, create_graph=True)
    assert g1 is not None and g1.data == pytest.approx(3 * 1.5**2)
    (g2,) = await grad(g1, x, create_graph=True)
    assert g2 is not None and g2.data == pytest.approx(6 * 1.5)
    (g3,) = await grad(g2, x)
    assert g3 is not None and g3.data == pytest.approx(6.0)


async def _first_derivative(f: Any, at: float) -> float:
    x = Variable(at, requires_grad=True)
    (g,) = await grad(f(x), x)
    assert g is not None
    return float(g.data)


@pytest.mark.anyio
async def test_second_derivative_through_several_paths_matches_finite_differences() -> None:
    def f(x: Variable) -> Variable:
        # x appears on four paths; two of them meet at h before reaching x.
        h = Sin.apply(x)
        return Add.apply(Mul.apply(h, Exp.apply(x)), Mul.apply(h, x))

    x = Variable(0.7, requires_grad=True)
    (g1,) = await grad(f(x), x, create_graph=True)
    assert g1 is not None
    (g2,) = await grad(g1, x)
    assert g2 is not None
    h = 1e-5
    fd = (await _first_derivative(f, 0.7 + h) - await _first_derivative(f, 0.7 - h)) / (2 * h)
    assert_close(g2.data, fd, rtol=1e-6, atol=1e-8, what="d2f/dx2")
    first_fd = central_difference(lambda xs: f(Variable(xs[0])).data, [0.7], 0)
    assert_close(g1.data, first_fd, rtol=1e-6, atol=1e-8, what="df/dx")


@pytest.mark.anyio
async def test_backward_with_create_graph_leaves_a_differentiable_grad() -> None:
    x = Variable(3.0, requires_grad=True)
    y = Mul.apply(x, x)
    await y.backward(create_graph=True)
    assert x.grad is not None and x.grad.data == 6.0
    assert x.grad.requires_grad
    g = x.grad
    x.grad = None
    await g.backward()  # d(2x)/dx
    assert x.grad is not None and x.grad.data == 2.0


@pytest.mark.anyio
async def test_mixed_partial_derivatives() -> None:
    x = Variable(2.0, requires_grad=True)
    w = Variable(5.0, requires_grad=True)
    y = Mul.apply(Mul.apply(x, x), w)  # x^2 w
    gx, gw = await grad(y, [x, w], create_graph=True)
    assert gx is not None and gx.data == 20.0  # 2xw
    assert gw is not None and gw.data == 4.0  # x^2
    dxx, dxw = await grad(gx, [x, w], retain_graph=True)
    assert dxx is not None and dxx.data == 10.0  # 2w
    assert dxw is not None and dxw.data == 4.0  # 2x
    (dwx,) = await grad(gw, [x])
    assert dwx is not None and dwx.data == 4.0


@pytest.mark.anyio
async def test_numpy_gradients_accumulate_elementwise() -> None:
    x = Variable(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = Mul.apply(x, x)
    await backward(y, np.ones(3))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.data, np.array([2.0, 4.0, 6.0]))


@pytest.mark.anyio
async def test_grad_error_types_are_asyncgraph_errors() -> None:
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    await y.backward()
    with pytest.raises(GraphError):
        await y.backward()
    assert issubclass(GraphError, asyncgraph.AsyncGraphError)
    assert issubclass(GraphError, RuntimeError)


# --- grad_outputs / grad_variables: one per output when the outputs are a sequence ------


@pytest.mark.anyio
async def test_grad_outputs_for_a_list_of_outputs_is_one_gradient_per_output() -> None:
    x = Variable(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = Mul.apply(x, Variable(np.array([2.0, 2.0, 2.0])))
    (gx,) = await asyncgraph.grad([y], [x], grad_outputs=[np.ones(3)], retain_graph=True)
    assert gx is not None and list(gx.data) == [2.0, 2.0, 2.0]
    s = Mul.apply(Variable(3.0, requires_grad=True), Variable(2.0))
    leaf = s.grad_fn.next_edges[0][0]  # type: ignore[union-attr, index]
    (gs,) = await asyncgraph.grad([s], [leaf], grad_outputs=[3.0])
    assert gs is not None and gs.data == 6.0
    (gt,) = await asyncgraph.grad(
        (y,), [x], grad_outputs=(np.array([1.0, 0.0, 2.0]),), retain_graph=True
    )
    assert gt is not None and list(gt.data) == [2.0, 0.0, 4.0]


@pytest.mark.anyio
async def test_backward_of_a_list_of_outputs_takes_one_gradient_per_output() -> None:
    a = Variable(2.0, requires_grad=True)
    b = Variable(5.0, requires_grad=True)
    await asyncgraph.backward([Mul.apply(a, b), Mul.apply(a, a)], grad_variables=[1.0, 10.0])
    assert a.grad is not None and a.grad.data == 5.0 + 40.0
    assert b.grad is not None and b.grad.data == 2.0


@pytest.mark.anyio
async def test_a_length_mismatch_of_grad_outputs_names_both_lengths() -> None:
    a = Variable(2.0, requires_grad=True)
    y = Mul.apply(a, a)
    with pytest.raises(GraphError, match="grad_outputs has 2 entries but outputs has 1"):
        await asyncgraph.grad([y], [a], grad_outputs=[1.0, 2.0])
    with pytest.raises(GraphError, match="grad_variables has 1 entries but variables has 2"):
        await asyncgraph.backward([y, y], grad_variables=[1.0])


@pytest.mark.anyio
async def test_a_single_bare_output_still_takes_a_list_as_its_text_feedback() -> None:
    from asyncgraph.text import concat

    a = Variable("a", role="a", requires_grad=True)
    y = concat(a, "b")
    await y.backward(["too short", "too vague"])
    assert a.grad is not None and a.grad.data == ["too short", "too vague"]


# --- .grad assignment and requires_grad_ ------------------------------------------------


def test_grad_accepts_a_variable_or_none_only_and_del_resets_it() -> None:
    x = Variable(1.0, requires_grad=True)
    x.grad = Variable(2.0)
    assert x.grad.data == 2.0
    with pytest.raises(TypeError, match="assigned grad must be a Variable or None, got float"):
        x.grad = 3.0  # type: ignore[assignment]
    assert x.grad.data == 2.0  # unchanged
    del x.grad
    assert x.grad is None
    x.grad = None
    assert x.grad is None


@pytest.mark.anyio
async def test_requires_grad_underscore_follows_pytorch() -> None:
    x = Variable(2.0)
    assert x.requires_grad_() is x and x.requires_grad
    assert x.requires_grad_(False) is x and not x.requires_grad
    x.requires_grad_(True)
    y = Mul.apply(x, x)
    assert y.requires_grad_(True) is y  # a non-leaf that requires grad: a no-op
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf variables"):
        y.requires_grad_(False)
    await y.backward()
    assert x.grad is not None and x.grad.data == 4.0


@pytest.mark.anyio
async def test_backward_takes_pytorchs_gradient_keyword() -> None:
    x = Variable(np.array([1.0, 2.0]), requires_grad=True)
    y = Mul.apply(x, Variable(np.array([3.0, 3.0])))
    await y.backward(gradient=np.array([1.0, 2.0]))
    assert x.grad is not None and list(x.grad.data) == [3.0, 6.0]
    with pytest.raises(TypeError, match="both grad and gradient"):
        await y.backward(1.0, gradient=1.0)


@pytest.mark.anyio
async def test_backward_takes_pytorchs_grad_tensors_keyword() -> None:
    a = Variable(2.0, requires_grad=True)
    await backward([Mul.apply(a, a)], grad_tensors=[3.0])
    assert a.grad is not None and a.grad.data == 12.0
    with pytest.raises(TypeError, match="both grad_variables and grad_tensors"):
        await backward([Mul.apply(a, a)], [1.0], grad_tensors=[1.0])
