"""``a + b`` on Variables: numbers add, texts concatenate, both differentiable."""

from __future__ import annotations

import numpy
import pytest

from asyncgraph import Parameter, Variable, grad, no_grad

pytestmark = pytest.mark.anyio


async def test_numbers_add_and_each_side_gets_the_gradient() -> None:
    a, b = Parameter(2.0, role="a"), Parameter(3, role="b")
    y = a + b
    assert y.data == 5.0 and y.role == "sum of a and b" and y.grad_fn is not None
    assert y.grad_fn.name == "Add"
    await y.backward()
    assert a.grad is not None and b.grad is not None
    assert (a.grad.data, b.grad.data) == (1, 1)


async def test_a_number_added_to_itself_gets_twice_the_gradient() -> None:
    # d(a + a)/da = 2, checked against a finite difference of the same expression.
    a = Parameter(1.5)
    (g,) = await grad(a + a, [a])
    eps = 1e-6
    assert g.data == pytest.approx(((a.data + eps) * 2 - (a.data - eps) * 2) / (2 * eps))


async def test_constants_on_either_side() -> None:
    a = Parameter(1.0, role="a")
    y = 2 + a + 0.5
    assert y.data == 3.5
    await y.backward()
    assert a.grad is not None and a.grad.data == 1


async def test_texts_concatenate_and_each_side_receives_the_feedback() -> None:
    greeting = Parameter("Hello, ", role="greeting")
    name = Parameter("Ada", role="name")
    y = greeting + name
    assert y.data == "Hello, Ada" and y.role == "concatenation of greeting and name"
    await y.backward(Variable("too formal"))
    assert greeting.grad is not None and name.grad is not None
    assert greeting.grad.data == "too formal" and name.grad.data == "too formal"


async def test_a_text_added_to_itself_receives_the_feedback_once() -> None:
    word = Parameter("ha", role="word")
    y = word + word
    assert y.data == "haha"
    await y.backward(Variable("not funny"))
    assert word.grad is not None and word.grad.data == "not funny"


async def test_text_with_constants_and_feedback_from_two_paths_in_graph_order() -> None:
    draft = Parameter("draft", role="draft")
    first = "Title: " + draft
    second = draft + " (end)"
    assert (first.data, second.data) == ("Title: draft", "draft (end)")
    await (first + second).backward(Variable("shorter"))
    assert draft.grad is not None and draft.grad.data == ["shorter", "shorter"]


async def test_arrays_broadcast_and_gradients_sum_back_to_each_shape() -> None:
    w = Parameter(numpy.array([1.0, 2.0, 3.0]), role="w")
    b = Parameter(numpy.array([[10.0], [20.0]]), role="b")
    c = Parameter(0.5, role="c")
    y = w + b + c
    assert y.data.shape == (2, 3)
    await y.backward(Variable(numpy.ones((2, 3))))
    assert w.grad is not None and b.grad is not None and c.grad is not None
    numpy.testing.assert_array_equal(w.grad.data, [2.0, 2.0, 2.0])
    numpy.testing.assert_array_equal(b.grad.data, [[3.0], [3.0]])
    assert c.grad.data == 6.0 and isinstance(c.grad.data, float)


async def test_higher_order_through_a_sum() -> None:
    a, b = Parameter(1.0), Parameter(2.0)
    (ga,) = await grad(a + b, [a], create_graph=True)
    assert ga.data == 1


def test_no_grad_records_nothing() -> None:
    a = Parameter("x")
    with no_grad():
        y = a + "y"
    assert y.data == "xy" and y.grad_fn is None


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (Variable("text", role="answer"), 3),
        (Variable(1.0), "x"),
        (Variable([1, 2], role="items"), Variable([3])),
        (Variable(True), 1),
        (Variable(None), 1),
    ],
)
def test_other_data_raises_naming_both_sides(left: Variable, right: object) -> None:
    with pytest.raises(TypeError, match="concatenates two texts or adds two numbers") as info:
        _ = left + right
    assert type(left.data).__name__ in str(info.value)
    if left.role:
        assert f"role {left.role!r}" in str(info.value)
