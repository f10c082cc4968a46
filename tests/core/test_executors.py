"""Executors: concurrency, limits, inline and threaded backwards, selection, events."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

import asyncgraph
from asyncgraph import (
    BackwardError,
    Executor,
    Function,
    GradManager,
    LocalExecutor,
    Node,
    NodeEvent,
    Parameter,
    Variable,
    backward,
    grad,
    use_executor,
)
from asyncgraph._core._executor import BatchingExecutor, current_executor

from ._ops import Add, AsyncIdentity, Mul

DEADLOCK_GUARD_S = 10  # only trips if the behaviour under test is broken


class Rendezvous(Function):
    """An async backward that waits until its partner's backward is running too."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        ctx.mine.set()
        await ctx.partner.wait()
        return g


def test_default_executor_is_an_unbounded_local_executor() -> None:
    ex = current_executor()
    assert isinstance(ex, LocalExecutor)
    assert ex.max_concurrency is None
    assert isinstance(ex, Executor)
    assert LocalExecutor().max_concurrency is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_max_concurrency_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        LocalExecutor(max_concurrency=bad)


@pytest.mark.anyio
async def test_async_backwards_run_concurrently() -> None:
    """Each backward waits for the other to have started: only concurrency completes."""
    x = Variable(1.0, requires_grad=True)
    a, b = Rendezvous.apply(x), Rendezvous.apply(x)
    assert a.grad_fn is not None and b.grad_fn is not None
    ea, eb = anyio.Event(), anyio.Event()
    a.grad_fn.ctx.mine, a.grad_fn.ctx.partner = ea, eb  # type: ignore[attr-defined]
    b.grad_fn.ctx.mine, b.grad_fn.ctx.partner = eb, ea  # type: ignore[attr-defined]
    with anyio.fail_after(DEADLOCK_GUARD_S):
        await backward([a, b], [1.0, 2.0])
    assert x.grad is not None and x.grad.data == 3.0


class Tracked(Function):
    """Counts how many of its backwards are running at the same time."""

    running = 0
    peak = 0
    ran = 0

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        Tracked.running += 1
        Tracked.peak = max(Tracked.peak, Tracked.running)
        for _ in range(5):  # give every other ready task a chance to start
            await anyio.lowlevel.checkpoint()
        Tracked.running -= 1
        Tracked.ran += 1
        return g


@pytest.mark.anyio
async def test_max_concurrency_one_serializes_async_backwards() -> None:
    Tracked.running = Tracked.peak = Tracked.ran = 0
    x = Variable(1.0, requires_grad=True)
    outs = [Tracked.apply(x) for _ in range(6)]
    await backward(outs, [1.0] * 6, executor=LocalExecutor(max_concurrency=1))
    assert Tracked.ran == 6
    assert Tracked.peak == 1
    assert x.grad is not None and x.grad.data == 6.0


@pytest.mark.anyio
async def test_max_concurrency_bounds_and_allows_that_many_at_once() -> None:
    Tracked.running = Tracked.peak = Tracked.ran = 0
    x = Variable(1.0, requires_grad=True)
    outs = [Tracked.apply(x) for _ in range(6)]
    await backward(outs, [1.0] * 6, executor=LocalExecutor(max_concurrency=3))
    assert Tracked.ran == 6
    assert Tracked.peak == 3


class WhereAmI(Function):
    tasks: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        WhereAmI.tasks.append(anyio.get_current_task().id)
        return g


class BlockingOp(Function):
    blocking = True

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


@pytest.mark.anyio
async def test_sync_backwards_run_inline_in_the_calling_task() -> None:
    WhereAmI.tasks.clear()
    x = Variable(1.0, requires_grad=True)
    y = WhereAmI.apply(WhereAmI.apply(x))
    await y.backward()
    me = anyio.get_current_task().id
    assert WhereAmI.tasks == [me, me]

    ex = LocalExecutor()
    for fn, inline in ((WhereAmI, True), (AsyncIdentity, False), (BlockingOp, False)):
        node = fn.apply(x).grad_fn
        assert node is not None
        assert ex.inline(node) is inline, fn.__name__


class ThreadedBackward(Function):
    blocking = True
    info: ClassVar[dict[str, Any]] = {}

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        ThreadedBackward.info["thread"] = threading.get_ident()
        # Hand the loop something to do and wait until it did it: only possible
        # if the loop keeps running while this backward blocks its thread.
        anyio.from_thread.run_sync(ctx.in_thread.set)
        ThreadedBackward.info["loop_ran"] = ctx.loop_ran.wait(DEADLOCK_GUARD_S)
        return Variable(g.data * 2)


@pytest.mark.anyio
async def test_blocking_function_runs_its_backward_in_a_worker_thread_without_blocking_the_loop() -> (
    None
):
    ThreadedBackward.info.clear()
    x = Variable(1.0, requires_grad=True)
    y = ThreadedBackward.apply(x)
    assert y.grad_fn is not None
    in_thread = anyio.Event()
    loop_ran = threading.Event()
    y.grad_fn.ctx.in_thread = in_thread  # type: ignore[attr-defined]
    y.grad_fn.ctx.loop_ran = loop_ran  # type: ignore[attr-defined]

    async def other_work_on_the_loop() -> None:
        await in_thread.wait()
        loop_ran.set()

    with anyio.fail_after(DEADLOCK_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_work_on_the_loop)
            await y.backward()
    assert ThreadedBackward.info["thread"] != threading.get_ident()
    assert ThreadedBackward.info["loop_ran"] is True
    assert x.grad is not None and x.grad.data == 2.0


class RecordingExecutor:
    """A third executor: runs nothing inline and records every node it runs."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, tuple[str, ...]]] = []

    def inline(self, node: Node) -> bool:
        return False

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        self.ran.append((node.name, node.input_roles))
        result = node.function.backward(node.ctx, *grad_outputs)
        if hasattr(result, "__await__"):
            result = await result
        return result


def _graph() -> tuple[Variable, Variable]:
    x = Variable(2.0, role="x", requires_grad=True)
    h = Mul.apply(x, x)
    h.role = "h"
    return x, AsyncIdentity.apply(h)


@pytest.mark.anyio
async def test_custom_executor_selected_by_the_executor_argument() -> None:
    rec = RecordingExecutor()
    assert isinstance(rec, Executor)
    x, y = _graph()
    await backward(y, executor=rec)
    assert rec.ran == [("AsyncIdentity", ("h",)), ("Mul", ("x", "x"))]
    assert x.grad is not None and x.grad.data == 4.0

    x, y = _graph()
    await y.backward(executor=rec)
    (gx,) = await grad(AsyncIdentity.apply(Mul.apply(x, x)), x, executor=rec)
    assert gx is not None and gx.data == 4.0
    assert len(rec.ran) == 6


@pytest.mark.anyio
async def test_use_executor_selects_the_default_for_this_task() -> None:
    rec = RecordingExecutor()
    other_task_executor: list[Executor] = []
    inside = anyio.Event()
    checked = anyio.Event()

    async def other_task() -> None:
        await inside.wait()
        other_task_executor.append(current_executor())
        checked.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        with use_executor(rec) as selected:
            assert selected is rec
            assert current_executor() is rec
            inside.set()
            await checked.wait()
            x, y = _graph()
            await y.backward()
    assert other_task_executor and other_task_executor[0] is not rec
    assert current_executor() is not rec
    assert [name for name, _ in rec.ran] == ["AsyncIdentity", "Mul"]
    assert x.grad is not None and x.grad.data == 4.0


@pytest.mark.anyio
async def test_grad_manager_uses_its_executor() -> None:
    rec = RecordingExecutor()
    w = Parameter(3.0)
    gm = GradManager(executor=rec).attach(w)
    with gm:
        await gm.backward(AsyncIdentity.apply(Mul.apply(w, w)))
    assert [name for name, _ in rec.ran] == ["AsyncIdentity", "Mul"]
    assert w.grad is not None and w.grad.data == 6.0


def test_use_executor_rejects_objects_that_are_not_executors() -> None:
    with pytest.raises(TypeError, match="Executor"), use_executor(object()):  # type: ignore[arg-type]
        pass


class AlwaysInline:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def inline(self, node: Node) -> bool:
        self.asked.append(node.name)
        return not node.function._backward_is_async

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        return await node.function.backward(node.ctx, *grad_outputs)


@pytest.mark.anyio
async def test_engine_asks_the_executor_whether_to_run_inline() -> None:
    ex = AlwaysInline()
    x, y = _graph()
    await backward(y, executor=ex)
    assert ex.asked == ["AsyncIdentity", "Mul"]
    assert x.grad is not None and x.grad.data == 4.0


@pytest.mark.anyio
async def test_listeners_get_started_and_finished_events_with_names_roles_and_times() -> None:
    events: list[NodeEvent] = []
    x = Variable(2.0, role="x", requires_grad=True)
    h = Mul.apply(x, x)
    h.role = "h"
    y = AsyncIdentity.apply(h)
    y.role = "y"
    await backward(y, listeners=[events.append])
    kinds = [(e.kind, e.function) for e in events]
    assert kinds == [
        ("started", "AsyncIdentity"),
        ("finished", "AsyncIdentity"),
        ("started", "Mul"),
        ("finished", "Mul"),
    ]
    assert events[0].input_roles == ("h",) and events[0].output_roles == ("",)
    assert events[2].input_roles == ("x", "x")
    assert all(e.error is None for e in events)
    times = [e.time_s for e in events]
    assert times == sorted(times)
    assert events[0].seq != events[2].seq


class Fails(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        raise KeyError("missing")


@pytest.mark.anyio
async def test_listeners_get_a_failed_event_with_the_error() -> None:
    events: list[NodeEvent] = []
    x = Variable(1.0, role="x", requires_grad=True)
    with pytest.raises(BackwardError):
        await backward(Add.apply(Fails.apply(x), x), listeners=[events.append])
    failed = [e for e in events if e.kind == "failed"]
    assert len(failed) == 1
    assert failed[0].function == "Fails" and failed[0].input_roles == ("x",)
    assert isinstance(failed[0].error, KeyError)
    assert ("started", "Fails") in [(e.kind, e.function) for e in events]
    assert asyncgraph.NodeEvent is NodeEvent


class ModeProbe(Function):
    """Reports the grad mode its backward runs in, wherever the executor runs it."""

    seen: ClassVar[list[tuple[str, bool]]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        ModeProbe.seen.append(("sync", asyncgraph.is_grad_enabled()))
        return Mul.apply(g, Variable(1.0))


class AsyncModeProbe(ModeProbe):
    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:  # type: ignore[override]
        ModeProbe.seen.append(("async", asyncgraph.is_grad_enabled()))
        return Mul.apply(g, Variable(1.0))


class BlockingModeProbe(ModeProbe):
    blocking = True

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        ModeProbe.seen.append(("thread", asyncgraph.is_grad_enabled()))
        return Mul.apply(g, Variable(1.0))


@pytest.mark.anyio
@pytest.mark.parametrize("create_graph", [False, True])
async def test_backwards_run_with_grad_enabled_exactly_when_create_graph(
    create_graph: bool,
) -> None:
    ModeProbe.seen.clear()
    x = Variable(2.0, requires_grad=True)
    y = BlockingModeProbe.apply(AsyncModeProbe.apply(ModeProbe.apply(Mul.apply(x, x))))
    (g,) = await grad(y, x, create_graph=create_graph)
    assert sorted(ModeProbe.seen) == [
        ("async", create_graph),
        ("sync", create_graph),
        ("thread", create_graph),
    ]
    assert g is not None and g.data == 4.0
    assert g.requires_grad is create_graph
    assert asyncgraph.is_grad_enabled()  # the caller's mode is untouched


class BatchProbe:
    """Runs async backwards itself; records, for each, whether more nodes were coming."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def inline(self, node: Node) -> bool:
        return not node.function._backward_is_async

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        raise AssertionError("the engine calls run_backward_batched when there is one")

    async def run_backward_batched(
        self, node: Node, grad_outputs: tuple[Variable | None, ...], more_coming: Any
    ) -> Any:
        self.seen.append(more_coming())
        return await node.function.backward(node.ctx, *grad_outputs)


@pytest.mark.anyio
@pytest.mark.parametrize("width", [1, 2, 10, 200])
async def test_more_coming_is_false_for_the_last_node_of_a_ready_level(width: int) -> None:
    probe = BatchProbe()
    assert isinstance(probe, BatchingExecutor)
    leaves = [Parameter(float(i)) for i in range(width)]
    await backward([AsyncIdentity.apply(p) for p in leaves], executor=probe)
    # An executor that batches may wait for the others, and must send at the last one.
    assert probe.seen == [True] * (width - 1) + [False]
    assert [p.grad.data for p in leaves] == [1.0] * width  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_more_coming_is_false_along_a_chain() -> None:
    probe = BatchProbe()
    x = Parameter(1.0)
    y = x
    for _ in range(5):
        y = AsyncIdentity.apply(y)
    await backward(y, executor=probe)
    assert probe.seen == [False] * 5


@pytest.mark.anyio
async def test_backward_of_inline_nodes_lets_other_tasks_run() -> None:
    """A pass that never waits still yields once: a loop of them cannot starve the loop."""
    ticks = 0
    done = False

    async def other() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        await anyio.lowlevel.checkpoint()
        before = ticks
        for _ in range(50):
            x = Parameter(2.0)
            await backward(Mul.apply(x, x))
            assert x.grad is not None and x.grad.data == 4.0
        assert ticks - before >= 25
        done = True
