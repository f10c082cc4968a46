"""Grad modes: context managers, decorators, and per-task isolation (contextvars)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
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


# --- Decorators in every form PyTorch allows, generators included ------------------------


def test_bare_and_parenthesised_decorators_on_sync_functions() -> None:
    @no_grad
    def bare() -> bool:
        return is_grad_enabled()

    @no_grad()
    def called() -> bool:
        return is_grad_enabled()

    def plain() -> bool:
        return is_grad_enabled()

    assert bare() is False and called() is False and no_grad(plain)() is False
    assert bare.__name__ == "bare"
    with no_grad():

        @enable_grad
        def on() -> bool:
            return is_grad_enabled()

        assert on() is True and enable_grad(plain)() is True
        assert set_grad_enabled(True)(plain)() is True
        assert is_grad_enabled() is False
    assert is_grad_enabled() is True
    with pytest.raises(TypeError, match="takes no mode"):
        no_grad(False)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_bare_decorator_on_a_coroutine_function() -> None:
    @no_grad
    async def inside() -> bool:
        await anyio.lowlevel.checkpoint()
        return is_grad_enabled()

    assert await inside() is False
    assert is_grad_enabled() is True


@pytest.mark.parametrize("form", ["bare", "called", "set_grad_enabled"])
def test_a_decorated_generator_runs_in_its_mode_at_every_step(form: str) -> None:
    seen: list[tuple[str, bool]] = []

    def stream() -> Generator[int, str, str]:
        for i in range(3):
            seen.append(("body", is_grad_enabled()))
            sent = yield i
            seen.append((f"got {sent}", is_grad_enabled()))
        return "done"

    decorated = {
        "bare": no_grad(stream),
        "called": no_grad()(stream),
        "set_grad_enabled": set_grad_enabled(False)(stream),
    }[form]
    assert is_grad_enabled() is True
    gen = decorated()
    assert next(gen) == 0
    assert is_grad_enabled() is True  # the caller's mode between steps
    assert gen.send("a") == 1
    assert is_grad_enabled() is True
    with enable_grad():
        assert gen.send("b") == 2
    with pytest.raises(StopIteration) as stop:
        gen.send("c")
    assert stop.value.value == "done"
    assert all(mode is False for _, mode in seen), seen
    assert [what for what, _ in seen][:3] == ["body", "got a", "body"]


def test_a_decorated_generator_records_no_graph_and_handles_throw_and_close() -> None:
    x = Variable(2.0, requires_grad=True)
    closed: list[bool] = []

    @no_grad()
    def doubles() -> Generator[Variable, None, None]:
        try:
            while True:
                try:
                    yield Mul.apply(x, Variable(2.0))
                except ValueError:
                    yield Variable(is_grad_enabled())
        finally:
            closed.append(is_grad_enabled())

    gen = doubles()
    y = next(gen)
    assert y.grad_fn is None and y.data == 4.0
    assert gen.throw(ValueError("again")).data is False  # throw runs in the mode too
    gen.close()
    assert closed == [False]  # close (GeneratorExit) too
    assert is_grad_enabled() is True
    assert Mul.apply(x, x).grad_fn is not None  # the caller records


@pytest.mark.anyio
async def test_a_decorated_async_generator_runs_in_its_mode_at_every_step() -> None:
    x = Variable(3.0, requires_grad=True)
    modes: list[bool] = []

    @no_grad
    async def stream() -> AsyncGenerator[Variable, str | None]:
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
            modes.append(is_grad_enabled())
            sent = yield Mul.apply(x, x)
            modes.append(sent is not None and not is_grad_enabled())

    outputs = []
    gen = stream()
    outputs.append(await gen.asend(None))
    assert is_grad_enabled() is True
    outputs.append(await gen.asend("next"))
    outputs.append(await gen.asend("next"))
    with pytest.raises(StopAsyncIteration):
        await gen.asend("last")
    assert all(o.grad_fn is None for o in outputs)  # a streaming wrapper records nothing
    assert modes == [False, True, False, True, False, True]
    assert Mul.apply(x, x).grad_fn is not None

    @no_grad()
    async def endless() -> AsyncGenerator[bool, None]:
        try:
            while True:
                yield is_grad_enabled()
        finally:
            modes.append(is_grad_enabled())

    agen = endless()
    async for mode in agen:
        assert mode is False
        break
    await agen.aclose()  # aclose runs the generator's finally in its mode
    assert modes[-1] is False
    assert is_grad_enabled() is True


@pytest.mark.anyio
async def test_a_generators_mode_does_not_leak_into_a_concurrent_task() -> None:
    @no_grad
    def slow() -> Generator[bool, None, None]:
        yield is_grad_enabled()
        yield is_grad_enabled()

    other: list[bool] = []
    stepped = anyio.Event()
    done = anyio.Event()

    async def watcher() -> None:
        await stepped.wait()
        other.append(is_grad_enabled())
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher)
        gen = slow()
        assert next(gen) is False
        stepped.set()
        await done.wait()
        assert next(gen) is False
    assert other == [True]
