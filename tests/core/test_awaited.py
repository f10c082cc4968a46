"""``loss.backward()`` without ``await`` says what happened, at the line that forgot."""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings

import pytest

from asyncgraph import GradManager, Parameter, backward, grad

from ._ops import Add, Mul


def _graph() -> tuple[Parameter, object]:
    x = Parameter(3.0)
    return x, Mul.apply(x, x)


def _dropped(calls: list[object]) -> list[warnings.WarningMessage]:
    """Drop the only reference to each call, recording what that warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls.clear()
        gc.collect()
    return list(caught)


def test_backward_without_await_warns_at_the_callers_line_and_computes_nothing() -> None:
    x, y = _graph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y.backward()  # type: ignore[attr-defined, unused-coroutine]
        line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    assert x.grad is None
    [w] = caught
    assert w.category is RuntimeWarning
    assert w.filename == __file__ and w.lineno == line
    message = str(w.message)
    assert "loss.backward() was called without await" in message
    assert "no gradient was computed" in message and "await loss.backward(...)" in message
    assert "never awaited" not in message  # not Python's generic warning


@pytest.mark.parametrize("name", ["backward", "grad", "gm.backward"])
def test_every_entry_point_of_a_pass_warns_in_its_own_name(name: str) -> None:
    x, y = _graph()
    calls: list[object] = []
    if name == "backward":
        calls.append(backward(y))  # type: ignore[arg-type]
    elif name == "grad":
        calls.append(grad(y, x))  # type: ignore[arg-type]
    else:
        gm = GradManager().attach([x])
        calls.append(gm.backward(y))  # type: ignore[arg-type]
    [w] = _dropped(calls)
    assert f"{name}() was called without await" in str(w.message)


def test_awaited_calls_do_not_warn_on_any_runner() -> None:
    import trio

    for run in (asyncio.run, trio.run):
        x, y = _graph()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if run is asyncio.run:
                asyncio.run(y.backward())  # type: ignore[attr-defined]  # a coroutine: accepted
            else:
                trio.run(y.backward)  # type: ignore[attr-defined]
            gc.collect()
        assert x.grad is not None and x.grad.data == 6.0


@pytest.mark.anyio
async def test_await_gives_the_same_gradient_as_before() -> None:
    x = Parameter(2.0)
    z = Add.apply(Mul.apply(x, x), x)
    await z.backward()
    assert x.grad is not None and x.grad.data == 5.0


def test_a_failed_call_is_not_reported_as_unawaited() -> None:
    _, y = _graph()
    calls = [y.backward(grad=1.0, gradient=1.0)]  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="both grad and gradient"):
        asyncio.run(calls[0])  # type: ignore[arg-type]
    assert _dropped(calls) == []
