"""``remote_forwards``: the forward of a remote Function with an async forward goes to the
executor's ``apply``; everything else (local Functions, no executor) runs here, and the
graph it records is the in-process one (grad mode and graph order of the call)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import anyio
import pytest

from asyncgraph import Function, Variable, backward, graph_order, no_grad, remote_forwards

pytestmark = pytest.mark.anyio


class Critique(Function):
    """Remote, async forward: ``text -> text``; its backward hands ``tag`` on as feedback."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    async def forward(ctx: Any, x: Variable, tag: str) -> Variable:
        ctx.tag = tag
        await anyio.lowlevel.checkpoint()
        return Variable(f"{x.data}+{tag}")

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[str, None]:
        return (f"from {ctx.tag}", None)


class SyncRemote(Function):
    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data * 2)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Any:
        return g.data * 2


class LocalAsync(Function):
    @staticmethod
    async def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data * 3)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Any:
        return g.data * 3


class InProcessFleet:
    """Runs each forward sent to it in this process, outside ``remote_forwards``, as a
    worker would, and remembers which Functions came."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def apply(self, fn: type[Function], *args: Any, **kwargs: Any) -> Any:
        self.sent.append(fn.__name__)
        await anyio.lowlevel.checkpoint()  # another task may run first
        with remote_forwards(None):
            return await fn.apply(*args, **kwargs)


async def _two_critiques_awaited_backwards(x: Variable) -> list[Variable]:
    """Two forwards applied in order a, b and awaited in order b, a, each in its task."""
    first = Critique.apply(x, "a")
    second = Critique.apply(x, "b")
    out: dict[str, Variable] = {}

    async def wait(name: str, pending: Any) -> None:
        out[name] = await pending

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "b", second)
        await anyio.lowlevel.checkpoint()
        tg.start_soon(wait, "a", first)
    return [out["a"], out["b"]]


async def test_a_remote_async_forward_goes_to_the_executor_with_the_in_process_graph() -> None:
    here = Variable("x", requires_grad=True, role="draft")
    outputs = await _two_critiques_awaited_backwards(here)
    await backward(outputs)

    fleet = InProcessFleet()
    there = Variable("x", requires_grad=True, role="draft")
    with remote_forwards(fleet):
        sent = await _two_critiques_awaited_backwards(there)
    await backward(sent)

    assert fleet.sent == ["Critique", "Critique"]
    assert [o.data for o in sent] == [o.data for o in outputs] == ["x+a", "x+b"]
    # Gradients meet in the order the forwards were applied, not awaited: as in-process.
    assert there.grad is not None and here.grad is not None
    assert there.grad.data == here.grad.data == ["from a", "from b"]
    first, second = (o.grad_fn for o in sent)
    assert first is not None and second is not None and first.seq < second.seq


async def test_grad_mode_and_graph_order_are_read_when_apply_is_called() -> None:
    fleet = InProcessFleet()
    x = Variable("x", requires_grad=True)
    with remote_forwards(fleet):
        with no_grad():
            pending = Critique.apply(x, "t")
        with graph_order(7):
            ordered = Critique.apply(x, "u")
        untracked, tracked = await pending, await ordered
    assert untracked.grad_fn is None and not untracked.requires_grad
    assert tracked.grad_fn is not None and tracked.grad_fn.seq[0] == 7


async def test_local_functions_and_a_block_without_executor_run_here() -> None:
    fleet = InProcessFleet()
    x = Variable(2.0, requires_grad=True)
    with remote_forwards(fleet):
        y = await LocalAsync.apply(x)
        with remote_forwards(None):
            z = await Critique.apply(Variable("t"), "v")
    assert fleet.sent == []
    assert y.data == 6.0 and z.data == "t+v"


async def test_a_synchronous_remote_forward_inside_the_block_says_to_make_it_async() -> None:
    with remote_forwards(InProcessFleet()):
        with pytest.raises(TypeError, match=r"SyncRemote.forward is synchronous.*async def"):
            SyncRemote.apply(Variable(1.0, requires_grad=True))
    assert SyncRemote.apply(Variable(1.0)).data == 2.0  # outside: as always


async def test_tasks_started_inside_the_block_send_their_forwards_too() -> None:
    fleet = InProcessFleet()
    results: list[Variable] = []

    async def one(i: int) -> None:
        results.append(await Critique.apply(Variable(str(i)), "w"))

    with remote_forwards(fleet):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
    assert fleet.sent == ["Critique"] * 3 and len(results) == 3


def test_remote_forwards_refuses_what_cannot_run_a_forward() -> None:
    with pytest.raises(TypeError, match=r"remote_forwards expects an executor with an async apply"):
        with remote_forwards(object()):  # type: ignore[arg-type]
            pass
