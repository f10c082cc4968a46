"""Grad modes: context managers, decorators, and per-task isolation (contextvars)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import (
    Function,
    Parameter,
    Variable,
    enable_grad,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)

from ._ops import Mul


def _recorded() -> bool:
    x = Variable(2.0, requires_grad=True)
    return Mul.apply(x, x).grad_fn is not None


def test_grad_is_enabled_by_default_and_applications_are_recorded() -> None:
    assert is_grad_enabled()
    assert _recorded()


def test_no_grad_context_disables_recording_and_restores() -> None:
    with no_grad():
        assert not is_grad_enabled()
        x = Variable(2.0, requires_grad=True)
        y = Mul.apply(x, x)
        assert y.grad_fn is None and not y.requires_grad and y.is_leaf
    assert is_grad_enabled()
    assert _recorded()


def test_enable_grad_inside_no_grad() -> None:
    with no_grad():
        with enable_grad():
            assert is_grad_enabled()
            assert _recorded()
        assert not is_grad_enabled()
    assert is_grad_enabled()


def test_grad_mode_is_restored_when_the_block_raises() -> None:
    with pytest.raises(ValueError, match="inside"), no_grad():
        raise ValueError("inside")
    assert is_grad_enabled()


def test_set_grad_enabled_as_a_context_manager_restores_the_previous_mode() -> None:
    with set_grad_enabled(False):
        assert not is_grad_enabled()
        assert not _recorded()
        with set_grad_enabled(True):
            assert is_grad_enabled()
        assert not is_grad_enabled()
    assert is_grad_enabled()


def test_set_grad_enabled_as_a_call_switches_immediately() -> None:
    try:
        set_grad_enabled(False)
        assert not is_grad_enabled()
        set_grad_enabled(True)
        assert is_grad_enabled()
    finally:
        set_grad_enabled(True)


def test_set_grad_enabled_requires_a_bool() -> None:
    with pytest.raises(TypeError, match="bool"):
        set_grad_enabled(0)  # type: ignore[arg-type]


def test_decorators_of_sync_functions() -> None:
    @no_grad()
    def without() -> tuple[bool, bool]:
        return is_grad_enabled(), _recorded()

    @enable_grad()
    def with_() -> tuple[bool, bool]:
        return is_grad_enabled(), _recorded()

    @set_grad_enabled(False)
    def disabled() -> bool:
        return is_grad_enabled()

    assert is_grad_enabled()  # decorating with set_grad_enabled does not switch the caller
    assert without() == (False, False)
    assert is_grad_enabled()
    with no_grad():
        assert with_() == (True, True)
        assert not is_grad_enabled()
    assert disabled() is False
    assert is_grad_enabled()
    assert without.__name__ == "without"  # functools.wraps


@pytest.mark.anyio
async def test_decorators_of_async_functions() -> None:
    @no_grad()
    async def without() -> tuple[bool, bool]:
        await anyio.lowlevel.checkpoint()
        return is_grad_enabled(), _recorded()

    @enable_grad()
    async def with_() -> bool:
        await anyio.lowlevel.checkpoint()
        return is_grad_enabled()

    @set_grad_enabled(False)
    async def disabled() -> bool:
        await anyio.lowlevel.checkpoint()
        return is_grad_enabled()

    assert await without() == (False, False)
    assert is_grad_enabled()
    with no_grad():
        assert await with_() is True
        assert not is_grad_enabled()
    assert await disabled() is False
    assert is_grad_enabled()


@pytest.mark.anyio
async def test_no_grad_in_one_task_never_leaks_into_another_on_the_same_loop() -> None:
    """Two tasks interleave (events force the order) while one is inside no_grad."""
    a_inside = anyio.Event()
    b_checked = anyio.Event()
    b_inside = anyio.Event()
    a_checked = anyio.Event()
    seen: dict[str, bool] = {}

    async def task_a() -> None:
        with no_grad():
            a_inside.set()
            await b_checked.wait()
            seen["a_still_disabled"] = not is_grad_enabled() and not _recorded()
            await b_inside.wait()
            seen["a_sees_own_mode_while_b_enables"] = not is_grad_enabled()
            a_checked.set()
        seen["a_after"] = is_grad_enabled()

    async def task_b() -> None:
        await a_inside.wait()
        seen["b_enabled_while_a_in_no_grad"] = is_grad_enabled() and _recorded()
        b_checked.set()
        with set_grad_enabled(False), enable_grad():
            b_inside.set()
            await a_checked.wait()
            seen["b_enabled_after_a_checked"] = is_grad_enabled()

    async with anyio.create_task_group() as tg:
        tg.start_soon(task_a)
        tg.start_soon(task_b)
    assert seen == {
        "a_still_disabled": True,
        "b_enabled_while_a_in_no_grad": True,
        "a_sees_own_mode_while_b_enables": True,
        "b_enabled_after_a_checked": True,
        "a_after": True,
    }
    assert is_grad_enabled()


@pytest.mark.anyio
async def test_decorated_coroutines_interleaving_keep_their_own_modes() -> None:
    in_disabled = anyio.Event()
    in_enabled = anyio.Event()
    seen: list[tuple[str, bool]] = []

    @no_grad()
    async def disabled() -> None:
        in_disabled.set()
        await in_enabled.wait()
        seen.append(("disabled", is_grad_enabled()))

    @enable_grad()
    async def enabled() -> None:
        await in_disabled.wait()
        in_enabled.set()
        seen.append(("enabled", is_grad_enabled()))

    with no_grad():  # the caller's mode is copied into the tasks; each changes only its own
        async with anyio.create_task_group() as tg:
            tg.start_soon(disabled)
            tg.start_soon(enabled)
        assert not is_grad_enabled()
    assert sorted(seen) == [("disabled", False), ("enabled", True)]


@pytest.mark.anyio
async def test_parameters_and_requires_grad_leaves_are_unaffected_by_no_grad() -> None:
    with no_grad():
        p = Parameter(2.0)
        v = Variable(3.0, requires_grad=True)
    y = Mul.apply(p, v)
    await y.backward()
    assert p.grad is not None and p.grad.data == 3.0
    assert v.grad is not None and v.grad.data == 2.0


class AsyncEcho(Function):
    @staticmethod
    async def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


@pytest.mark.anyio
async def test_async_apply_uses_the_grad_mode_of_the_call_not_of_the_await() -> None:
    x = Variable(1.0, requires_grad=True)
    with no_grad():
        pending = AsyncEcho.apply(x)
    assert (await pending).grad_fn is None
    recorded = AsyncEcho.apply(x)
    with no_grad():
        y = await recorded
    assert y.grad_fn is not None
