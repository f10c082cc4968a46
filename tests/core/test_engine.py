"""The backward engine: dependency counting, failure, cancellation, long chains."""

from __future__ import annotations

import gc
import itertools
import sys
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Function, LocalExecutor, Variable, backward, grad

from ._ops import Add, AsyncIdentity, Identity, Mul

DEADLOCK_GUARD_S = 10  # only trips if the behaviour under test is broken


class Step(Function):
    """An async pass-through whose backward logs its start and end and may run a
    coroutine (``ctx.during``) in between."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        ctx.log.append(("start", ctx.name))
        if ctx.during is not None:
            await ctx.during()
        ctx.log.append(("end", ctx.name))
        return g


def step(
    x: Variable,
    name: str,
    log: list[tuple[str, str]],
    during: Callable[[], Awaitable[Any]] | None = None,
) -> Variable:
    y = Step.apply(x)
    assert y.grad_fn is not None
    ctx = y.grad_fn.ctx
    ctx.name, ctx.log, ctx.during = name, log, during  # type: ignore[attr-defined]
    return y


@pytest.mark.anyio
async def test_a_node_starts_the_moment_its_last_gradient_arrives() -> None:
    """Uneven branches: the short branch runs to its end while the long one is
    still in its first node; the node where they meet starts right after the
    last branch hands its gradient on, and only then."""
    log: list[tuple[str, str]] = []
    s1_started = anyio.Event()

    async def signal_s1() -> None:
        s1_started.set()

    x = Variable(1.0, role="x", requires_grad=True)
    m = step(x, "M", log)
    long_branch = step(step(step(m, "L1", log), "L2", log), "L3", log, during=s1_started.wait)
    short_branch = step(step(m, "S1", log, during=signal_s1), "S2", log)
    y = Add.apply(long_branch, short_branch)
    with anyio.fail_after(DEADLOCK_GUARD_S):
        await y.backward()
    assert log.index(("start", "S1")) < log.index(("end", "L3"))
    assert log.index(("end", "S1")) < log.index(("end", "L3"))
    assert log.count(("start", "M")) == 1
    m_start = log.index(("start", "M"))
    assert m_start > log.index(("end", "S1"))
    assert m_start == log.index(("end", "L1")) + 1
    assert x.grad is not None and x.grad.data == 2.0


class CountCalls(Function):
    calls: ClassVar[list[Any]] = []

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        CountCalls.calls.append(g.data)
        return g


@pytest.mark.anyio
async def test_a_node_with_several_consumers_runs_once_with_the_summed_gradient() -> None:
    CountCalls.calls.clear()
    log: list[tuple[str, str]] = []
    x = Variable(1.0, requires_grad=True)
    h = CountCalls.apply(x)
    a = step(h, "A", log)
    b = step(step(h, "B1", log), "B2", log)
    c = Mul.apply(h, Variable(10.0))
    await backward([a, b, c], [1.0, 2.0, 3.0])
    assert CountCalls.calls == [33.0]
    assert x.grad is not None and x.grad.data == 33.0


class Sleeper(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        ctx.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            ctx.flags.append("sleeper cancelled")
        return g  # pragma: no cover


class Boom(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        await ctx.wait_for.wait()
        raise ValueError("model refused")


class SyncBoom(Function):
    @staticmethod
    def forward(ctx: Any, a: Variable) -> Variable:
        return Variable(a.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        raise ZeroDivisionError("sync failure")


@pytest.mark.anyio
async def test_a_failing_node_cancels_the_others_and_raises_backward_error() -> None:
    x = Variable(1.0, role="draft", requires_grad=True)
    z = Variable(2.0, role="context", requires_grad=True)
    earlier = Variable(5.0)
    x.grad = earlier
    flags: list[str] = []
    started = anyio.Event()
    sleeper = Sleeper.apply(x)
    assert sleeper.grad_fn is not None
    sleeper.grad_fn.ctx.started, sleeper.grad_fn.ctx.flags = started, flags  # type: ignore[attr-defined]
    boom = Boom.apply(x, z)
    assert boom.grad_fn is not None
    boom.grad_fn.ctx.wait_for = started  # type: ignore[attr-defined]
    quick = Mul.apply(z, Variable(3.0))  # z's gradient from here is known early
    y = Add.apply(Add.apply(sleeper, boom), quick)
    with anyio.fail_after(DEADLOCK_GUARD_S), pytest.raises(BackwardError) as info:
        await y.backward()
    error = info.value
    assert error.function == "Boom"
    assert error.input_roles == ("draft", "context")
    assert "Boom" in str(error) and "'draft'" in str(error) and "'context'" in str(error)
    assert "model refused" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert error.__cause__.__traceback__ is not None
    assert flags == ["sleeper cancelled"]
    assert x.grad is earlier and x.grad.data == 5.0  # leaves untouched after a failed pass
    assert z.grad is None


@pytest.mark.anyio
async def test_a_failing_sync_node_raises_backward_error_with_the_cause() -> None:
    x = Variable(1.0, role="w", requires_grad=True)
    y = Mul.apply(SyncBoom.apply(x), Variable(2.0))
    with pytest.raises(BackwardError, match="SyncBoom") as info:
        await y.backward()
    assert info.value.input_roles == ("w",)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert x.grad is None


@pytest.mark.anyio
async def test_a_failed_grad_call_raises_backward_error_too() -> None:
    x = Variable(1.0, role="w", requires_grad=True)
    with pytest.raises(BackwardError, match="SyncBoom"):
        await grad(SyncBoom.apply(x), x)


class Incompatible(Function):
    """Returns text for a numeric input: summing it with a number must fail clearly."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> str:
        return "text feedback"


@pytest.mark.anyio
async def test_gradients_that_cannot_be_summed_raise_backward_error() -> None:
    x = Variable(1.0, role="w", requires_grad=True)
    y = Add.apply(Incompatible.apply(x), Mul.apply(x, Variable(2.0)))
    with pytest.raises(BackwardError, match="cannot sum the gradients flowing into leaf") as info:
        await y.backward()
    assert "'w'" in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)
    assert x.grad is None

    h = Mul.apply(x, Variable(1.0))  # a non-leaf receiving text and a number
    y = Add.apply(Incompatible.apply(h), Mul.apply(h, Variable(2.0)))
    with pytest.raises(BackwardError, match="cannot sum the gradients flowing into") as info:
        await y.backward()
    assert info.value.function == "Mul"
    assert isinstance(info.value.__cause__, TypeError)
    assert x.grad is None


@pytest.mark.anyio
@pytest.mark.parametrize("text_leaf_first", [True, False])
async def test_no_grad_changes_when_adding_to_an_existing_grad_fails(text_leaf_first: bool) -> None:
    a = Variable(1.0, role="a", requires_grad=True)
    b = Variable(1.0, role="b", requires_grad=True)
    a.grad = Variable(10.0)
    b.grad = Variable("earlier text feedback")  # a number cannot be added to it
    pair = (b, a) if text_leaf_first else (a, b)
    y = Add.apply(Mul.apply(pair[0], Variable(2.0)), Mul.apply(pair[1], Variable(3.0)))
    with pytest.raises(TypeError):
        await y.backward()
    assert a.grad.data == 10.0
    assert b.grad.data == "earlier text feedback"


class Forever(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        ctx.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            ctx.flags.append(ctx.name)
        return g  # pragma: no cover


@pytest.mark.anyio
async def test_cancelling_the_caller_cancels_every_running_node() -> None:
    x = Variable(1.0, requires_grad=True)
    flags: list[str] = []
    started = [anyio.Event(), anyio.Event()]
    outs = []
    for name, event in zip(("first", "second"), started, strict=True):
        out = Forever.apply(x)
        assert out.grad_fn is not None
        ctx = out.grad_fn.ctx
        ctx.started, ctx.flags, ctx.name = event, flags, name  # type: ignore[attr-defined]
        outs.append(out)
    y = Add.apply(*outs)
    finished: list[str] = []
    scope = anyio.CancelScope()

    async def caller() -> None:
        with scope:
            await y.backward()
            finished.append("backward returned")  # pragma: no cover
        finished.append(f"cancelled: {scope.cancelled_caught}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        with anyio.fail_after(DEADLOCK_GUARD_S):
            for event in started:
                await event.wait()
        scope.cancel()  # both nodes are running now
    assert finished == ["cancelled: True"]
    assert sorted(flags) == ["first", "second"]
    assert x.grad is None


@pytest.mark.anyio
async def test_fail_after_around_backward_cancels_running_nodes() -> None:
    x = Variable(1.0, requires_grad=True)
    flags: list[str] = []
    y = Forever.apply(x)
    assert y.grad_fn is not None
    ctx = y.grad_fn.ctx
    ctx.started, ctx.flags, ctx.name = anyio.Event(), flags, "only"  # type: ignore[attr-defined]
    with pytest.raises(TimeoutError), anyio.fail_after(0.01):  # the node never finishes
        await y.backward()
    assert flags == ["only"]
    assert x.grad is None


def _chain(fn: type[Function], length: int) -> tuple[Variable, Variable]:
    x = Variable(1.0, requires_grad=True)
    y = x
    gc_was_enabled = gc.isenabled()
    gc.disable()  # many small objects: the cyclic GC would only slow the build down
    try:
        for _ in range(length):
            y = fn.apply(y)
    finally:
        if gc_was_enabled:
            gc.enable()
    return x, y


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
    return depth


@pytest.mark.anyio
async def test_a_chain_far_deeper_than_the_recursion_limit_needs_no_recursion() -> None:
    # The smallest proof: with the recursion limit a few hundred frames above where the
    # test stands, a chain 100 times longer than that headroom backpropagates (so does
    # building it and freeing it). A recursive engine would fail with RecursionError.
    headroom = 200
    length = 100 * headroom
    old_limit = sys.getrecursionlimit()
    x, y = _chain(Identity, length)
    sys.setrecursionlimit(_stack_depth() + headroom)
    try:
        await y.backward()
    finally:
        sys.setrecursionlimit(old_limit)
    assert x.grad is not None and x.grad.data == 1.0


@pytest.mark.anyio
async def test_a_ten_thousand_node_chain_of_async_nodes_needs_no_recursion() -> None:
    x, y = _chain(AsyncIdentity, 10_000)
    await y.backward(2.0)
    assert x.grad is not None and x.grad.data == 2.0


@pytest.mark.anyio
async def test_long_inline_chains_let_other_tasks_run() -> None:
    """A long run of inline nodes checkpoints now and then: a sibling task gets the loop."""
    _, y = _chain(Identity, 20_000)
    progressed: list[int] = []
    done = anyio.Event()

    async def sibling() -> None:
        while not done.is_set():
            progressed.append(1)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sibling)
        await anyio.lowlevel.checkpoint()  # let the sibling start
        before = len(progressed)
        await y.backward()
        during = len(progressed) - before
        done.set()
    assert during >= 2


class _Parked(Function):
    """An async pass-through that counts itself started, then waits for ``ctx.release``."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        ctx.started.append(1)
        await ctx.release.wait()
        return g


@pytest.mark.anyio
async def test_a_wide_level_of_waiting_nodes_starts_in_waves_that_let_other_tasks_run() -> None:
    """Nodes that wait each get a runner, started a few hundred per pass of the event loop
    at most: a sibling task runs between the waves (thousands at once would hold the loop
    for as long as their first steps take)."""
    started: list[int] = []
    release = anyio.Event()
    leaves = [Variable(1.0, requires_grad=True) for _ in range(2100)]
    outs = []
    for leaf in leaves:
        out = _Parked.apply(leaf)
        assert out.grad_fn is not None
        out.grad_fn.ctx.started, out.grad_fn.ctx.release = started, release  # type: ignore[attr-defined]
        outs.append(out)
    seen: list[int] = []  # nodes started, at each step of the sibling

    async def sibling() -> None:
        while len(started) < len(leaves):
            seen.append(len(started))
            await anyio.lowlevel.checkpoint()
        release.set()

    with anyio.fail_after(DEADLOCK_GUARD_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sibling)
            await backward(outs)
    assert all(leaf.grad is not None and leaf.grad.data == 1.0 for leaf in leaves)
    # A wave starts in one pass; on trio the sibling may run before one wave and after
    # the next: two waves between its steps at most (doubling, the last wave was 1,024).
    assert max(b - a for a, b in itertools.pairwise(seen)) <= 512


class _Batching(LocalExecutor):
    """A LocalExecutor with the protocol's optional batching method."""

    async def run_backward_batched(
        self, node: Any, grads: tuple[Variable | None, ...], more_coming: Any
    ) -> Any:
        more_coming()
        return await self.run_backward(node, grads)


@pytest.mark.anyio
@pytest.mark.parametrize("executor", [LocalExecutor(), _Batching()], ids=["local", "batching"])
async def test_a_pass_leaves_no_reference_cycle_for_the_collector(executor: Any) -> None:
    """A pass's engine, graph and gradients are freed by reference counting as soon as
    they are dropped: a cycle would keep them (and every gradient) until a full collection."""

    gc.collect()
    gc.disable()
    try:
        x = Variable(1.0, requires_grad=True)
        await backward([AsyncIdentity.apply(x) for _ in range(50)], executor=executor)
        assert x.grad is not None and x.grad.data == 50.0
        del x
        assert gc.collect() == 0
    finally:
        gc.enable()


class Nap(Function):
    """An async pass-through that waits a little, so a wide level keeps every node in flight."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        await anyio.sleep(0.01)
        return Variable(g.data * 2)


@pytest.mark.anyio
async def test_a_wide_pass_runs_in_the_task_group_and_a_failure_cancels_the_rest() -> None:
    # The pass starts its tasks with the task group's public start_soon only (no
    # backend's nursery): 64 waiting nodes side by side, then one failing among them.
    leaves = [Variable(1.0, requires_grad=True) for _ in range(64)]
    await backward([Nap.apply(p) for p in leaves])
    assert [p.grad.data for p in leaves] == [2.0] * 64  # type: ignore[union-attr]

    x, z = Variable(1.0, requires_grad=True), Variable(2.0, requires_grad=True)
    flags: list[str] = []
    started = anyio.Event()
    sleeper = Sleeper.apply(x)
    assert sleeper.grad_fn is not None
    sleeper.grad_fn.ctx.started, sleeper.grad_fn.ctx.flags = started, flags  # type: ignore[attr-defined]
    boom = Boom.apply(x, z)
    assert boom.grad_fn is not None
    boom.grad_fn.ctx.wait_for = started  # type: ignore[attr-defined]
    with anyio.fail_after(DEADLOCK_GUARD_S), pytest.raises(BackwardError, match="model refused"):
        await backward([sleeper, boom, *(Nap.apply(p) for p in leaves)])
    assert flags == ["sleeper cancelled"]
