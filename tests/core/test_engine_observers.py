"""``observe_nodes`` (listeners for every pass in a block) and ``current_node()``."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import (
    Function,
    Node,
    NodeEvent,
    Variable,
    backward,
    current_node,
    grad,
    observe_nodes,
)

from ._ops import Add, Mul

pytestmark = pytest.mark.anyio


class Seen:
    """Records which node ``current_node()`` names inside each kind of backward."""

    nodes: ClassVar[list[tuple[str, Node | None]]] = []


class InlineSeen(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        Seen.nodes.append(("inline", current_node()))
        return g


class AsyncSeen(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        await anyio.lowlevel.checkpoint()
        found: list[Node | None] = []

        async def child() -> None:  # a task the backward starts inherits it
            found.append(current_node())

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        Seen.nodes.append(("async", current_node()))
        Seen.nodes.append(("child", found[0]))
        return g


class ThreadSeen(Function):
    blocking = True

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        Seen.nodes.append(("thread", current_node()))
        return g


async def test_current_node_names_the_node_whose_backward_runs() -> None:
    Seen.nodes = []
    x = Variable(1.0, requires_grad=True)
    a = InlineSeen.apply(x)
    b = AsyncSeen.apply(a)
    c = ThreadSeen.apply(b)
    assert current_node() is None
    await backward(c)
    assert current_node() is None
    by_kind = dict(Seen.nodes)
    assert by_kind["thread"] is c.grad_fn
    assert by_kind["async"] is b.grad_fn
    assert by_kind["child"] is b.grad_fn
    assert by_kind["inline"] is a.grad_fn


async def test_observe_nodes_sees_every_pass_in_the_block_with_node_and_grads() -> None:
    events: list[NodeEvent] = []
    x = Variable(2.0, requires_grad=True)
    y = Mul.apply(x, x)
    with observe_nodes(events.append):
        await backward(y, retain_graph=True)
        await grad(y, x, retain_graph=True)
    await backward(y)  # after the block: not observed
    started = [e for e in events if e.kind == "started"]
    assert len(started) == 2
    assert all(e.node is y.grad_fn for e in started)
    assert [g.data for g in started[0].grads if g is not None] == [1.0]
    assert [e.kind for e in events] == ["started", "finished"] * 2


async def test_observe_nodes_and_explicit_listeners_both_hear_a_pass() -> None:
    outer: list[str] = []
    inner: list[str] = []
    explicit: list[str] = []
    x = Variable(1.0, requires_grad=True)
    with observe_nodes(lambda e: outer.append(e.kind)):
        with observe_nodes(lambda e: inner.append(e.kind)):
            await backward(Add.apply(x, x), listeners=[lambda e: explicit.append(e.kind)])
    assert outer == inner == explicit == ["started", "finished"]


async def test_observe_nodes_does_not_leak_into_other_tasks() -> None:
    events: list[NodeEvent] = []
    entered = anyio.Event()
    done = anyio.Event()

    async def observed() -> None:
        with observe_nodes(events.append):
            entered.set()
            await done.wait()

    async def other() -> None:
        await entered.wait()
        x = Variable(1.0, requires_grad=True)
        await backward(Add.apply(x, x))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(observed)
        tg.start_soon(other)
    assert events == []


def test_observe_nodes_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match="callable taking a NodeEvent"):
        with observe_nodes("print"):  # type: ignore[arg-type]
            pass
