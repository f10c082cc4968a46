"""The Executor protocol's submission methods: nodes that wait without a task each.

NOTE [Submitted nodes] in ``asyncgraph._core._engine``. ``Mailbox`` takes every node
with an async backward: it queues the node where the test sees it and answers when the
test says so, in any order, as a worker fleet's replies come.
"""

from __future__ import annotations

import contextvars
import random
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import (
    BackwardError,
    Function,
    LocalExecutor,
    Node,
    NodeEvent,
    Parameter,
    Variable,
    backward,
    current_node,
)
from asyncgraph._core._executor import SubmittingExecutor

from ._ops import Add, AsyncIdentity

DEADLINE_S = 10  # only trips if the behaviour under test is broken


class _Handle:
    def __init__(self, node: Node, grads: tuple[Variable | None, ...], done: Any) -> None:
        self.node, self.grads, self.done = node, grads, done
        self.error: Exception | None = None


class Mailbox:
    """Submits every node with an async backward; ``answer`` completes one."""

    def __init__(self, *, refuse: type[Function] | None = None) -> None:
        self.out: list[_Handle] = []
        self.sends: list[int] = []  # how many were out at each send_submitted
        self.submitters: set[Any] = set()  # the tasks that submitted
        self.collectors: set[Any] = set()  # the tasks that collected
        self.abandoned: list[_Handle] = []
        self.collected: list[_Handle] = []
        self.ran_as_task: list[str] = []
        self.arrived = anyio.Event()
        self._refuse = refuse

    def inline(self, node: Node) -> bool:
        return not node.function._backward_is_async

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        self.ran_as_task.append(node.name)
        return await node.function.backward(node.ctx, *grad_outputs)

    def submits(self, node: Node) -> bool:
        return node.function is not self._refuse

    def submit_backward(
        self, node: Node, grad_outputs: tuple[Variable | None, ...], done: Any
    ) -> _Handle:
        if node.name == "Unsendable":
            raise TypeError("ctx.model cannot travel")
        self.submitters.add(anyio.get_current_task().id)
        handle = _Handle(node, grad_outputs, done)
        self.out.append(handle)
        self.arrived.set()
        return handle

    async def send_submitted(self) -> None:
        self.sends.append(len(self.out))

    def collect_backward(self, handle: _Handle) -> Any:
        self.collected.append(handle)
        self.collectors.add(anyio.get_current_task().id)
        if handle.error is not None:
            raise handle.error
        return handle.grads[0]  # what AsyncIdentity's backward returns

    async def abandon_submitted(self, handles: list[_Handle]) -> None:
        await anyio.lowlevel.checkpoint()  # shielded: it may wait (a worker's report)
        self.abandoned += handles

    def answer(self, handle: _Handle, error: Exception | None = None) -> None:
        self.out.remove(handle)
        handle.error = error
        handle.done.put(handle)

    async def answer_in_turn(self, count: int) -> None:
        """Answer ``count`` nodes one at a time, each once it is out (a chain's pace)."""
        for _ in range(count):
            await self.wait_for(1)
            self.answer(self.out[0])

    async def wait_for(self, count: int) -> None:
        with anyio.fail_after(DEADLINE_S):
            while len(self.out) < count:
                self.arrived = anyio.Event()
                await self.arrived.wait()


class Unsendable(AsyncIdentity):
    pass


async def _answer_all_reversed(box: Mailbox, count: int) -> None:
    await box.wait_for(count)
    for handle in reversed(list(box.out)):
        box.answer(handle)


def test_the_mailbox_is_a_submitting_executor() -> None:
    assert isinstance(Mailbox(), SubmittingExecutor)


@pytest.mark.anyio
@pytest.mark.parametrize("width", [1, 3, 200])
async def test_a_ready_level_is_submitted_from_one_task_and_sent_once(width: int) -> None:
    box = Mailbox()
    leaves = [Parameter(float(i)) for i in range(width)]
    outs = [AsyncIdentity.apply(p) for p in leaves]
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_all_reversed, box, width)
        await backward(outs, executor=box)
    assert box.sends == [width]  # the whole level in one batch
    assert len(box.submitters) == 1  # no task per node
    assert box.ran_as_task == [] and box.abandoned == []
    assert [p.grad.data for p in leaves] == [1.0] * width  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_a_chain_of_submitted_nodes_sends_each_at_once() -> None:
    box = Mailbox()
    x = Parameter("x")
    y: Variable = x
    for _ in range(4):
        y = AsyncIdentity.apply(y)

    async with anyio.create_task_group() as tg:
        tg.start_soon(box.answer_in_turn, 4)
        await backward(y, grad_tensors="g", executor=box)
    assert box.sends == [1, 1, 1, 1]  # a lone node never waits for company
    assert x.grad is not None and x.grad.data == "g"


@pytest.mark.anyio
async def test_gradients_are_summed_in_graph_order_whatever_the_order_of_replies() -> None:
    """Text gradients do not commute: the sum must be the sequential run's."""
    expected = None
    for reverse in (False, True):
        box = Mailbox()
        x = Parameter("x")
        parts = [AsyncIdentity.apply(x) for _ in range(5)]
        total = parts[0]
        for part in parts[1:]:
            total = Add.apply(total, part)

        async def answer(box: Mailbox = box, reverse: bool = reverse) -> None:
            await box.wait_for(5)
            order = list(box.out)
            seqs = sorted(h.node.seq for h in order)
            for i, handle in enumerate(reversed(order) if reverse else order):
                handle.grads = (Variable(f"g{seqs.index(handle.node.seq)}"),)
                box.answer(handle)
                if i % 2:
                    await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            await backward(total, grad_tensors="seed", executor=box)
        assert x.grad is not None
        if expected is None:
            expected = x.grad.data
        assert x.grad.data == expected


@pytest.mark.anyio
async def test_a_failed_node_fails_the_pass_and_the_others_are_abandoned() -> None:
    box = Mailbox()
    leaves = [Parameter(1.0) for _ in range(4)]
    outs = [AsyncIdentity.apply(p) for p in leaves]

    async def fail_one() -> None:
        await box.wait_for(4)
        box.answer(box.out[1], RuntimeError("the worker's model refused"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fail_one)
        with pytest.raises(BackwardError, match="the worker's model refused") as info:
            await backward(outs, executor=box)
    assert info.value.function == "AsyncIdentity"
    assert len(box.abandoned) == 3  # cancelled where they run, reports collected
    assert all(p.grad is None for p in leaves)  # all or nothing


@pytest.mark.anyio
async def test_a_cancelled_caller_abandons_what_is_out() -> None:
    box = Mailbox()
    leaves = [Parameter(1.0) for _ in range(3)]
    outs = [AsyncIdentity.apply(p) for p in leaves]
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            await backward(outs, executor=box)

        tg.start_soon(run)
        await box.wait_for(3)
        tg.cancel_scope.cancel()
    assert sorted(id(h) for h in box.abandoned) == sorted(id(h) for h in box.out)
    assert all(p.grad is None for p in leaves)


@pytest.mark.anyio
async def test_a_node_that_cannot_be_submitted_fails_the_pass_and_nothing_stays_out() -> None:
    box = Mailbox()
    a, b = Parameter(1.0), Parameter(2.0)
    outs = [AsyncIdentity.apply(a), Unsendable.apply(b)]
    with pytest.raises(BackwardError, match=r"ctx\.model cannot travel") as info:
        await backward(outs, executor=box)
    assert info.value.function == "Unsendable"
    assert box.abandoned == box.out  # the one submitted before is cancelled, never sent
    assert box.sends == []


@pytest.mark.anyio
async def test_a_node_the_executor_does_not_take_runs_as_a_task() -> None:
    box = Mailbox(refuse=Unsendable)
    a, b = Parameter(1.0), Parameter(2.0)
    outs = [AsyncIdentity.apply(a), Unsendable.apply(b)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_all_reversed, box, 1)
        await backward(outs, executor=box)
    assert box.ran_as_task == ["Unsendable"]
    assert a.grad is not None and b.grad is not None


@pytest.mark.anyio
async def test_listeners_see_each_submitted_node_start_and_finish() -> None:
    box = Mailbox()
    events: list[NodeEvent] = []
    leaves = [Parameter(1.0) for _ in range(3)]
    outs = [AsyncIdentity.apply(p) for p in leaves]
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_all_reversed, box, 3)
        await backward(outs, executor=box, listeners=[events.append])
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["started"] * 3 and kinds[3:] == ["finished"] * 3
    assert all(e.grads for e in events[:3])


_SPAN: contextvars.ContextVar[str | None] = contextvars.ContextVar("span", default=None)


@pytest.mark.anyio
async def test_each_submitted_node_has_a_context_of_its_own_from_start_to_finish() -> None:
    """What a "started" listener makes current (a tracing span) is current for that node's
    submission and its "finished" listeners, and for no other node: as with a task each."""
    box = Mailbox()
    seen: dict[str, list[str | None]] = {}

    def listener(event: NodeEvent) -> None:
        key = str(event.seq)
        if event.kind == "started":
            assert _SPAN.get() is None  # not the previous node's
            _SPAN.set(key)
        seen.setdefault(key, []).append(_SPAN.get())

    submit = box.submit_backward

    def submit_in_span(node: Node, grads: Any, done: Any) -> _Handle:
        seen.setdefault(str(node.seq), []).append(_SPAN.get())
        return submit(node, grads, done)

    box.submit_backward = submit_in_span  # type: ignore[method-assign]
    leaves = [Parameter(1.0) for _ in range(3)]
    outs = [AsyncIdentity.apply(p) for p in leaves]
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_all_reversed, box, 3)
        await backward(outs, executor=box, listeners=[listener])
    assert len(seen) == 3
    for key, spans in seen.items():
        assert spans == [key, key, key]  # started, submitted, finished
    assert _SPAN.get() is None


@pytest.mark.anyio
async def test_nodes_submitted_after_a_reply_do_not_inherit_an_earlier_nodes_context() -> None:
    """The collector that finishes the first node submits the next ones: their contexts
    are copies of the pass's, not of the first node's."""
    box = Mailbox()
    seen: list[str | None] = []

    def listener(event: NodeEvent) -> None:
        if event.kind == "started":
            seen.append(_SPAN.get())
            _SPAN.set(str(event.seq))

    x = Parameter("x")
    y = AsyncIdentity.apply(AsyncIdentity.apply(AsyncIdentity.apply(x)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(box.answer_in_turn, 3)
        await backward(y, grad_tensors="g", executor=box, listeners=[listener])
    assert seen == [None, None, None]


@pytest.mark.anyio
async def test_a_chain_is_collected_by_the_callers_own_task() -> None:
    """Work first: with nothing but submitted nodes to wait for, the caller's task waits for
    them itself (no task group to open and close per pass, as for a lone local node)."""
    box = Mailbox()
    x = Parameter("x")
    y = AsyncIdentity.apply(AsyncIdentity.apply(x))

    caller = anyio.get_current_task().id
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.answer_in_turn, 2)
        await backward(y, grad_tensors="g", executor=box)
    assert box.submitters == box.collectors == {caller}
    assert x.grad is not None and x.grad.data == "g"


class LocalSlow(AsyncIdentity):
    """Refused by the mailbox: run by a task of the pass."""


@pytest.mark.anyio
async def test_work_that_needs_a_task_after_a_submitted_node_hands_over_to_the_task_group() -> None:
    box = Mailbox(refuse=LocalSlow)
    x = Parameter("x")
    mid = LocalSlow.apply(AsyncIdentity.apply(x))  # submitted, then a task's node
    y = AsyncIdentity.apply(Add.apply(mid, AsyncIdentity.apply(x)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(box.answer_in_turn, 3)
        await backward(y, grad_tensors="g", executor=box)
    assert box.ran_as_task == ["LocalSlow"]
    assert len(box.collected) == 3 and box.abandoned == []
    assert x.grad is not None and x.grad.data == ["g", "g"]


@pytest.mark.anyio
@pytest.mark.parametrize("hand_over", [False, True])
async def test_current_node_names_the_submitted_node_from_start_to_finish(hand_over: bool) -> None:
    """Whichever task collects it (the caller's own, or a task of the pass's group while
    the caller's runs a slow local node), current_node() is the submitted node in its
    collection and its listeners."""
    box = Mailbox(refuse=LocalSlow)
    seen: list[tuple[str, Node | None, Node | None]] = []

    def listener(event: NodeEvent) -> None:
        if event.node is not None and event.node.name == "AsyncIdentity":
            seen.append((event.kind, event.node, current_node()))

    collect = box.collect_backward

    def collect_and_look(handle: _Handle) -> Any:
        seen.append(("collected", handle.node, current_node()))
        return collect(handle)

    box.collect_backward = collect_and_look  # type: ignore[method-assign]
    a, b = Parameter(1.0), Parameter(2.0)
    outs = [AsyncIdentity.apply(a)]
    if hand_over:
        outs.append(LocalSlow.apply(b))
    async with anyio.create_task_group() as tg:
        tg.start_soon(_answer_all_reversed, box, 1)
        await backward(outs, executor=box, listeners=[listener])
    assert [kind for kind, _, _ in seen] == ["started", "collected", "finished"]
    assert all(node is current for _, node, current in seen)


@pytest.mark.anyio
async def test_a_failed_submitted_node_is_reported_to_listeners() -> None:
    box = Mailbox()
    events: list[NodeEvent] = []
    outs = [AsyncIdentity.apply(Parameter(1.0)), Unsendable.apply(Parameter(2.0))]
    with pytest.raises(BackwardError):
        await backward(outs, executor=box, listeners=[events.append])
    failed = [e for e in events if e.kind == "failed"]
    assert [e.function for e in failed] == ["Unsendable"]
    assert isinstance(failed[0].error, TypeError)  # what the submission raised, as for any node

    box, events = Mailbox(), []
    leaf = Parameter(1.0)

    async def refuse() -> None:
        await box.wait_for(1)
        box.answer(box.out[0], RuntimeError("refused"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(refuse)
        with pytest.raises(BackwardError, match="refused"):
            await backward(AsyncIdentity.apply(leaf), executor=box, listeners=[events.append])
    assert [e.kind for e in events] == ["started", "failed"]


class SendFails(Mailbox):
    async def send_submitted(self) -> None:
        raise RuntimeError("the queue is gone")


@pytest.mark.anyio
async def test_an_executor_that_fails_to_send_fails_the_pass_naming_a_node() -> None:
    box = SendFails()
    leaves = [Parameter(1.0) for _ in range(2)]
    with pytest.raises(BackwardError, match="the queue is gone") as info:
        await backward([AsyncIdentity.apply(p) for p in leaves], executor=box)
    assert info.value.function == "AsyncIdentity"
    assert len(box.abandoned) == 2
    assert all(p.grad is None for p in leaves)


@pytest.mark.anyio
async def test_a_level_wider_than_one_loop_pass_leaves_in_parts_and_lets_the_loop_run() -> None:
    """At most 256 nodes are encoded between two passes of the event loop (as many as
    runners once started): the first 256 leave while the rest are encoded, and other
    tasks (a heartbeat) run in between."""
    box = Mailbox()
    ticks: list[int] = []

    async def heartbeat() -> None:
        while True:
            ticks.append(len(box.out))
            await anyio.lowlevel.checkpoint()

    leaves = [Parameter(1.0) for _ in range(600)]
    outs = [AsyncIdentity.apply(p) for p in leaves]
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        tg.start_soon(_answer_all_reversed, box, 600)
        await backward(outs, executor=box)
        tg.cancel_scope.cancel()
    assert box.sends == [256, 512, 600]
    assert any(0 < n < 600 for n in ticks)  # the loop ran while the level was submitted
    assert all(p.grad is not None for p in leaves)


class Tag(Function):
    """Marks the gradient with its name: text gradients that tell the order they met."""

    @staticmethod
    def forward(ctx: Any, x: Variable, name: str) -> Variable:
        ctx.name = name
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        return Variable(f"{g.data}>{ctx.name}"), None


class ShuffledReplies(Mailbox):
    """Submits every Tag node (the rest run inline) and answers them in a random order."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def inline(self, node: Node) -> bool:
        return node.function is not Tag

    def submits(self, node: Node) -> bool:
        return node.function is Tag

    def collect_backward(self, handle: _Handle) -> Any:
        return Tag.backward(handle.node.ctx, *handle.grads)

    async def answer_at_random(self) -> None:
        while True:
            if self.out:
                picked = self.rng.sample(self.out, self.rng.randint(1, len(self.out)))
                for handle in picked:
                    self.answer(handle)
                    if self.rng.random() < 0.3:
                        await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()


def _random_text_graph(seed: int) -> tuple[list[Parameter], list[Variable]]:
    rng = random.Random(seed)
    leaves = [Parameter(f"x{i}") for i in range(rng.randint(1, 3))]
    values: list[Variable] = list(leaves)
    for i in range(rng.randint(3, 25)):
        if rng.random() < 0.6:
            values.append(Tag.apply(rng.choice(values[-6:]), f"t{i}"))
        else:
            values.append(Add.apply(rng.choice(values), rng.choice(values[-4:])))
    outputs = rng.sample(values[len(leaves) :], rng.randint(1, min(3, len(values) - len(leaves))))
    return leaves, outputs


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(40))
async def test_random_graphs_get_the_sequential_gradients_whatever_the_order_of_replies(
    seed: int,
) -> None:
    """Exactly as a sequential run (the local executor): text gradients record the order
    of every sum, so any reply order leaking into the result shows."""
    leaves, outputs = _random_text_graph(seed)
    seeds = [f"s{k}" for k in range(len(outputs))]
    await backward(outputs, seeds, executor=LocalExecutor())
    expected = [None if p.grad is None else p.grad.data for p in leaves]

    leaves, outputs = _random_text_graph(seed)
    box = ShuffledReplies(random.Random(seed))
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.answer_at_random)
        await backward(outputs, seeds, executor=box)
        tg.cancel_scope.cancel()
    assert [None if p.grad is None else p.grad.data for p in leaves] == expected
    assert box.out == [] and box.abandoned == []
