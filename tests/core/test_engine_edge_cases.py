"""Edge cases found in review: ordering of async forwards, keyword inputs, cancellation of
threaded nodes, observers, hooks that wait, retrying a failed pass, shared grad-mode objects."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from asyncgraph import (
    BackwardError,
    Function,
    GraphError,
    Parameter,
    Variable,
    backward,
    graph_order,
    is_grad_enabled,
    no_grad,
    set_grad_enabled,
)

from ._ops import Add, AsyncIdentity, Mul


class Ask(Function):
    """Async forward that waits ``delay`` before answering; text feedback backward."""

    @staticmethod
    async def forward(ctx: Any, x: Variable, delay: float) -> Variable:
        ctx.tag = f"via {delay}"
        await anyio.sleep(delay)
        return Variable(f"{x.data}!")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, None]:
        return (ctx.tag, None)


@pytest.mark.anyio
@pytest.mark.parametrize("delays", [(0.0, 0.03), (0.03, 0.0)])
async def test_feedback_order_follows_apply_order_not_forward_completion(
    delays: tuple[float, float],
) -> None:
    x = Parameter("draft", role="draft")
    results: dict[int, Variable] = {}

    async def run(i: int) -> None:
        results[i] = await Ask.apply(x, delays[i])

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(run, i)
            await anyio.lowlevel.checkpoint()  # apply(0) is called before apply(1)
    await Add.apply(results[0], results[1]).backward()
    assert x.grad is not None
    assert x.grad.data == [f"via {delays[0]}", f"via {delays[1]}"]


class Lin(Function):
    """y = x + 2a + 3b with keyword inputs a and b."""

    @staticmethod
    def forward(ctx: Any, x: Variable, *, a: Variable, b: Variable) -> Variable:
        return Variable(x.data + 2 * a.data + 3 * b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, Any, Any]:
        need = ctx.needs_input_grad
        return (
            g.data if need[0] else None,
            2 * g.data if need[1] else None,
            3 * g.data if need[2] else None,
        )


@pytest.mark.anyio
async def test_keyword_inputs_bind_in_signature_order_whatever_the_call_order() -> None:
    x, a, b = Parameter(1.0), Parameter(1.0), Parameter(1.0)
    await Lin.apply(x, b=b, a=a).backward()
    assert (x.grad.data, a.grad.data, b.grad.data) == (1.0, 2.0, 3.0)  # type: ignore[union-attr]
    y = Lin.apply(x, a=Variable(0.0), b=b)
    assert y.grad_fn.requires_input_grad == (True, False, True)


class Blocking(Function):
    blocking = True
    started = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        Blocking.started.set()
        time.sleep(0.2)
        return g


@pytest.mark.anyio
async def test_cancelling_during_a_threaded_backward_commits_nothing() -> None:
    Blocking.started.clear()
    x = Parameter(2.0)
    y = Mul.apply(Blocking.apply(x), Variable(3.0))
    with anyio.move_on_after(0.05) as scope:
        await y.backward()
    assert scope.cancelled_caught
    assert x.grad is None


@pytest.mark.anyio
async def test_a_listener_that_raises_does_not_break_the_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def bad(event: Any) -> None:
        raise ValueError("observer bug")

    x = Parameter(2.0)
    await backward(Mul.apply(x, x), listeners=[bad])
    assert x.grad is not None and x.grad.data == 4.0
    assert "observer bug" in caplog.text


@pytest.mark.anyio
async def test_async_hooks_on_different_leaves_run_concurrently() -> None:
    leaves = [Parameter(1.0, role=f"leaf{i}") for i in range(3)]
    arrived = 0
    all_arrived = anyio.Event()

    async def hook(g: Variable) -> None:
        nonlocal arrived
        arrived += 1
        if arrived == len(leaves):
            all_arrived.set()
        with anyio.fail_after(60):
            await all_arrived.wait()  # deadlocks (and fails) if hooks run one at a time

    for leaf in leaves:
        leaf.register_hook(hook)
    await backward([AsyncIdentity.apply(leaf) for leaf in leaves], [1.0] * 3)
    assert [leaf.grad.data for leaf in leaves] == [1.0, 1.0, 1.0]  # type: ignore[union-attr]


class Flaky(Function):
    fail = True

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        ctx.save_for_backward(x)
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        if Flaky.fail:
            raise ConnectionError("model returned 503")
        return g


@pytest.mark.anyio
async def test_a_failed_pass_can_be_retried_and_a_successful_one_frees_the_graph() -> None:
    x = Parameter(1.0)
    y = Mul.apply(Flaky.apply(x), Variable(2.0))
    Flaky.fail = True
    with pytest.raises(BackwardError, match="503"):
        await y.backward()
    assert x.grad is None
    Flaky.fail = False
    await y.backward()
    assert x.grad is not None and x.grad.data == 2.0
    with pytest.raises(GraphError, match="retain_graph=True"):
        await y.backward()


@pytest.mark.anyio
async def test_one_no_grad_object_shared_by_interleaving_tasks() -> None:
    shared = no_grad()
    inside = [anyio.Event(), anyio.Event()]
    seen: dict[int, list[bool]] = {0: [], 1: []}

    async def task(i: int) -> None:
        with shared:
            inside[i].set()
            await inside[1 - i].wait()
            seen[i].append(is_grad_enabled())
        seen[i].append(is_grad_enabled())

    async with anyio.create_task_group() as tg:
        tg.start_soon(task, 0)
        tg.start_soon(task, 1)
    assert seen == {0: [False, True], 1: [False, True]}
    assert is_grad_enabled()


def test_set_grad_enabled_object_sets_its_mode_on_every_entry() -> None:
    manager = set_grad_enabled(False)
    with manager:
        assert not is_grad_enabled()
    assert is_grad_enabled()
    with manager:
        assert not is_grad_enabled()
    assert is_grad_enabled()


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [3.0, "text", {"a": 1}])
async def test_backward_of_a_non_variable_says_what_it_got(bad: Any) -> None:
    with pytest.raises(TypeError, match="must be a Variable or a list/tuple of Variables"):
        await backward(bad)


@pytest.mark.anyio
async def test_backward_of_nothing_is_an_error() -> None:
    with pytest.raises(GraphError, match="no variables"):
        await backward([])


class ForgotAsync(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Any:
        async def later() -> Variable:
            return g

        return later()


@pytest.mark.anyio
async def test_a_sync_backward_returning_a_coroutine_is_a_clear_error() -> None:
    with pytest.raises(BackwardError, match="async def backward"):
        await ForgotAsync.apply(Parameter(1.0)).backward()


@pytest.mark.anyio
@pytest.mark.parametrize("start_order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
async def test_graph_order_makes_concurrently_built_graphs_deterministic(
    start_order: tuple[int, int, int],
) -> None:
    """Tasks that build parts of one graph start in any order; graph_order(i) decides."""
    x = Parameter("draft", role="draft")
    outputs: dict[int, Variable] = {}

    async def build(i: int) -> None:
        with graph_order(i):
            outputs[i] = await Ask.apply(x, 0.0)
            outputs[i].grad_fn.ctx.tag = f"example {i}"  # type: ignore[union-attr]

    async with anyio.create_task_group() as tg:
        for i in start_order:
            tg.start_soon(build, i)
    joined = Add.apply(Add.apply(outputs[2], outputs[0]), outputs[1])
    await joined.backward()
    assert x.grad is not None
    assert x.grad.data == ["example 0", "example 1", "example 2"]


def test_graph_order_keys_are_ints() -> None:
    with pytest.raises(TypeError, match="ints"), graph_order("a"):  # type: ignore[arg-type]
        pass


class Barrier(Function):
    """Async backward that waits until every one of its kind has started."""

    total = 0
    started = 0
    all_started: anyio.Event | None = None

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        assert Barrier.all_started is not None
        Barrier.started += 1
        if Barrier.started == Barrier.total:
            Barrier.all_started.set()
        with anyio.fail_after(10):  # only trips if the nodes do not all run at once
            await Barrier.all_started.wait()
        return g


@pytest.mark.anyio
async def test_hundreds_of_waiting_nodes_all_run_at_once() -> None:
    Barrier.total, Barrier.started, Barrier.all_started = 300, 0, anyio.Event()
    x = Parameter(1.0)
    outs = [Barrier.apply(x) for _ in range(300)]
    await backward(outs, [1.0] * 300)
    assert x.grad is not None and x.grad.data == 300.0
