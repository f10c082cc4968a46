"""The async backward engine: find what is ready, run it, hand its gradients on.

One pass owns one task group. Dependency counts over the graph reachable from
the roots say when a node has all of its incoming gradients; at that moment it
is ready. Ready nodes whose backward is cheap and synchronous run inline in
the task that made them ready (no task, microseconds); the others run as tasks
of the pass's task group, so independent slow backwards overlap. Gradients
flowing into one place are summed in graph order (consumer creation order,
then input position), never in completion order. Leaves' ``.grad`` are
written only after the whole pass succeeded; a leaf's post-accumulate-grad hooks
run inside the pass, with that pass's gradient, the moment it is final.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel

from asyncgraph._exceptions import BackwardError, GraphError

from ._accumulate import accumulate
from ._function import Function
from ._grad_mode import _GRAD_ENABLED
from ._graph import Edge, Hook, Node, PostAccumulateHook, Seq, make_zero
from ._planning import make_plan
from ._variable import Variable

if TYPE_CHECKING:
    from asyncgraph._core._executor import Executor

__all__ = ["Engine", "NodeEvent", "current_node", "observe_nodes"]

_SEED_SEQ: Seq = (sys.maxsize,)  # seeds sort after every node's edges
_YIELD_EVERY = 1024  # inline nodes between checkpoints, so a long chain never starves the loop
_MAX_NEW_RUNNERS = 256  # runners started in one pass of the event loop at most
_key = itemgetter(0)
_log = logging.getLogger("asyncgraph")

Target = Node | Variable
Contribution = tuple[tuple[Seq, int], int, Variable | None]
WorkItem = tuple[Node, tuple[Variable | None, ...]]


# NOTE [Submitted nodes]
# A node that waits on something outside this process (a remote backward: a reply from a
# worker) needs no task of its own while it waits. For an executor with the protocol's
# submission methods (``SubmittingExecutor`` in ``_executor``), ``_dispatch`` hands each
# node the executor ``submits(node)`` to ``submit_backward(node, grads, done)`` at once, from
# the task that made it ready: the executor encodes and queues it and returns a handle.
# ``_drain`` then awaits ``send_submitted()`` once, before it returns: a ready level leaves
# in one batch, a lone node (a chain) at once; a level wider than ``_MAX_NEW_RUNNERS``
# leaves that many at a time, the loop running in between (as many as runners start in one
# pass of the loop: a wide level never holds it). When a node's outcome is in (result,
# failure, timeout with its diagnosis), the executor calls ``done.put(handle)``; one
# collector at a time (``_collect``) finishes each node with ``collect_backward(handle)``
# (the backward's result, or its error raised), finishes together the nodes that came
# together, then drains once. Work first, as for a chain of local nodes: while the pass has
# nothing else to wait for, the pass's own task is the collector (no task group to open and
# close: a lone remote round trip costs no more than with a task per node); once a node
# makes work that needs a task (a runner, a hook), a task of the group takes over the
# collecting. Each submitted node has a context of its own, a copy of the submitting
# task's (as its own task would have had) with a current-node cell of its own (NOTE
# [Current node]): its "started" listeners and its submission run in it, later its result
# and its "finished" or "failed" listeners, so that what a listener makes current there (a
# tracing span, which the task carries to the worker) is the node's alone, and
# ``current_node()`` names it, whichever task collects it. Order rules are untouched:
# gradients are summed in graph order, whatever the order of the replies. A pass that ends
# with handles out (it failed, or its caller was cancelled) awaits
# ``abandon_submitted(handles)``, shielded: the executor cancels them where they run and
# collects what they report; ``done`` is closed with the pass (a late ``put`` is dropped).
# ``send_submitted`` and ``abandon_submitted`` report through ``done``; one that raises
# fails the pass (or is logged, when the pass ends anyway). Against a task per waiting
# node (the runner's), this saves the task, its cancel scope and its frames: about a third
# of the client's CPU per remote node and most of its garbage collector's work in a wide
# remote pass (docs/guide/benchmarks.md).
class _Completions:
    """Where an executor puts the handles of submitted nodes whose outcome is in (NOTE
    [Submitted nodes]); not the engine itself, so that a handle never refers to it."""

    __slots__ = ("closed", "ready", "wakeup")

    def __init__(self) -> None:
        self.ready: list[Any] = []
        self.wakeup: anyio.Event | None = None
        self.closed = False

    def put(self, handle: Any) -> None:
        if self.closed:  # the pass is over (e.g. a diagnosis that ended after it): dropped
            return
        self.ready.append(handle)
        if self.wakeup is not None:
            self.wakeup.set()

    def close(self) -> None:
        self.closed = True
        self.ready.clear()


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """What listeners of a backward pass receive for every node that runs.

    ``time_s`` is ``time.perf_counter()`` when it happened; ``seq`` identifies the
    node (its creation order); ``node`` is the node itself and, on ``"started"``,
    ``grads`` the gradients it receives (one per output, None where none flows).

    Example::

        events = []
        await loss.backward(listeners=[events.append])
        for event in events:
            print(event.kind, event.function, event.input_roles, event.time_s)
    """

    kind: Literal["started", "finished", "failed"]
    function: str
    input_roles: tuple[str, ...]
    output_roles: tuple[str, ...]
    seq: Seq
    time_s: float
    error: BaseException | None = None
    node: Node | None = None
    grads: tuple[Variable | None, ...] = ()


Listener = Callable[[NodeEvent], object]

_LISTENERS: contextvars.ContextVar[tuple[Listener, ...]] = contextvars.ContextVar(
    "asyncgraph_listeners", default=()
)
# NOTE [Current node]: each task that runs nodes (the caller's, each runner, each hooked
# node's) gets a one-slot list, its "cell", once; the engine writes the running node into
# it around each backward. Tasks and threads a backward starts copy the context, so they
# see the same cell, which holds that node until the backward returns (they end before
# it: structured concurrency). Two stores into the cell are cheaper than setting a
# contextvar per node.
_CURRENT_NODE: contextvars.ContextVar[list[Node | None] | None] = contextvars.ContextVar(
    "asyncgraph_current_node", default=None
)


@contextmanager
def observe_nodes(listener: Listener) -> Iterator[None]:
    """Send the ``NodeEvent``s of every pass started inside the block to ``listener``.

    Like ``backward(..., listeners=[listener])`` for every ``backward`` / ``grad``
    called in this task (and the tasks it starts) while the block is open, including
    those a library makes for you (a job runner, an optimizer). A contextvar: other
    tasks are not observed. Blocks nest; the listener is called in the task running
    the node, and one that raises is logged and ignored::

        with observe_nodes(print):
            await loss.backward()
    """
    if not callable(listener):
        raise TypeError(f"observe_nodes expects a callable taking a NodeEvent, got {listener!r}")
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield
    finally:
        _LISTENERS.reset(token)


@dataclass(frozen=True)
class PassInfo:
    """What a pass observer learns of a backward pass when it starts.

    Example::

        @contextmanager
        def announce(info):
            print(info.roots, info.create_graph, info.executor)   # 1 False LocalExecutor
            yield

        with observe_passes(announce):
            await loss.backward()
    """

    roots: int
    create_graph: bool
    executor: str


PassObserver = Callable[[PassInfo], AbstractContextManager[object]]
_PASS_OBSERVERS: contextvars.ContextVar[tuple[PassObserver, ...]] = contextvars.ContextVar(
    "asyncgraph_pass_observers", default=()
)


@contextmanager
def observe_passes(observer: PassObserver) -> Iterator[None]:
    """Enter ``observer(PassInfo)`` (a context manager) around every pass started in the block.

    The pass runs inside it: what it sets in the context (a tracing span, say) is seen
    by every node of the pass, in every task the pass starts. A contextvar, like
    ``observe_nodes``; blocks nest.

    Example::

        @contextmanager
        def timed(info):
            start = time.perf_counter()
            yield
            print(f"{info.executor} pass: {time.perf_counter() - start:.2f}s")

        with observe_passes(timed):
            await loss.backward()
    """
    if not callable(observer):
        raise TypeError(
            f"observe_passes expects a callable returning a context manager, got {observer!r}"
        )
    token = _PASS_OBSERVERS.set((*_PASS_OBSERVERS.get(), observer))
    try:
        yield
    finally:
        _PASS_OBSERVERS.reset(token)


def current_node() -> Node | None:
    """The node whose backward runs in this task right now, else None.

    Set by the engine around each backward it runs (inline, async, in a thread or
    through an executor) and inherited by the tasks that backward starts: a model
    call can tell which node it belongs to (``asyncgraph.observe`` uses it).

    Example::

        class Logged(Function):
            @staticmethod
            def forward(ctx, x):
                return Variable(x.data)

            @staticmethod
            def backward(ctx, grad):
                print("in", current_node().name)    # in Logged
                return grad
    """
    cell = _CURRENT_NODE.get()
    return None if cell is None else cell[0]


class _GradSum(Function):
    """The engine's sum of several incoming gradients, recorded under create_graph."""

    @staticmethod
    def forward(ctx: Any, *grads: Variable) -> Variable:
        data = grads[0].data
        for g in grads[1:]:
            data = accumulate(data, g.data)
        return Variable(data)

    @staticmethod
    def backward(ctx: Any, grad: Variable | None) -> tuple[Variable | None, ...]:
        return tuple(grad if needs else None for needs in ctx.needs_input_grad)


class _GradCopy(Function):
    """A ``.grad``'s own copy of a gradient with history, under create_graph (PyTorch's
    AccumulateGrad clones it: ``CopyBackwards`` / ``CloneBackward`` in its graph)."""

    @staticmethod
    def forward(ctx: Any, grad: Variable) -> Variable:
        return Variable(_own_data(grad.data))

    @staticmethod
    def backward(ctx: Any, grad: Variable | None) -> Variable | None:
        return grad


def sum_grads(grads: Sequence[Variable | None], create_graph: bool) -> Variable | None:
    """Sum gradients left to right, skipping None; differentiable under create_graph."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    if create_graph:
        return _GradSum.apply(*present)  # type: ignore[no-any-return]
    data = present[0].data
    for g in present[1:]:
        data = accumulate(data, g.data)
    return Variable(data)


def _own_data(data: Any) -> Any:
    """``data``, with its own copy of a list or numpy array (a str or number is immutable)."""
    if isinstance(data, list):
        return list(data)
    if type(data).__module__ == "numpy" and hasattr(data, "copy"):
        return data.copy()
    return data


def own_grad(grad: Variable, create_graph: bool) -> Variable:
    """The gradient a ``.grad`` keeps: a Variable of its own, never the caller's or another
    leaf's (as PyTorch clones it), with its own copy of a list or numpy array, so that
    changing one ``.grad`` in place changes no other. Under create_graph, a gradient with
    history gets a differentiable copy (PyTorch's ``clone()``: its history is the point,
    kept through the copy's node); one without history is copied as any other."""
    if create_graph and (grad.grad_fn is not None or grad.requires_grad):
        copy: Variable = _GradCopy.apply(grad)
        copy.role = grad.role
        return copy
    return Variable(_own_data(grad.data), role=grad.role)


def normalize_grads(node: Node, result: Any) -> tuple[Variable | None, ...]:
    """Check a backward's return value against the node's inputs; wrap raw data."""
    n = len(node.next_edges)
    if not isinstance(result, tuple):
        if hasattr(result, "__await__"):
            if hasattr(result, "close"):
                result.close()
            raise GraphError(
                f"{node.name}.backward returned an awaitable: declare it `async def backward` "
                f"so the engine awaits it"
            )
        result = (result,)
    if len(result) > n and all(g is None for g in result[n:]):
        result = result[:n]  # trailing Nones past the inputs are accepted, as in PyTorch
    if len(result) != n:
        hint = " (a list is one gradient's data; return a tuple for several)" if n > 1 else ""
        raise GraphError(
            f"function {node.name}.backward returned an incorrect number of gradients "
            f"(expected {n}, got {len(result)}): forward had {n} input(s) (roles: "
            f"{list(node.input_roles)!r}); return one gradient or None per forward input, "
            f"positional arguments first, then keyword arguments in forward's signature "
            f"order{hint}"
        )
    out: list[Variable | None] = []
    for i, g in enumerate(result):
        if g is None:
            out.append(None)
            continue
        if not node.input_variables[i]:
            raise GraphError(
                f"function {node.name}.backward returned a gradient different than None at "
                f"position {i + 1}, but the corresponding forward input was not a Variable; "
                f"return None for it"
            )
        if not node.requires_input_grad[i]:
            # A Variable that needs no gradient: dropped, as PyTorch does (many backwards
            # compute every input's gradient without reading ctx.needs_input_grad).
            out.append(None)
            continue
        out.append(g if isinstance(g, Variable) else Variable(g))
    return tuple(out)


async def run_hooks(hooks: dict[int, Hook], grad: Variable | None, role: str) -> Variable | None:
    """Run gradient hooks in registration order; a returned value replaces the gradient.

    ``grad`` is None for an output that got no gradient while a sibling output did: its
    hooks see None, as PyTorch's tensor hooks do, and may return one."""
    for fn in list(hooks.values()):
        try:
            result = fn(grad)
            if hasattr(result, "__await__"):
                result = await result
        except Exception as exc:
            raise BackwardError(
                f"gradient hook {getattr(fn, '__qualname__', fn)!r} on variable "
                f"{role!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        if result is not None:
            grad = result if isinstance(result, Variable) else Variable(result)
    return grad


async def run_post_hooks(
    hooks: dict[int, PostAccumulateHook], leaf: Variable, grad: Variable
) -> None:
    """Run a leaf's post-accumulate-grad hooks in registration order (each returns None)."""
    for fn in list(hooks.values()):
        name = getattr(fn, "__qualname__", fn)
        try:
            result = fn(leaf, grad)
            if hasattr(result, "__await__"):
                result = await result
        except Exception as exc:
            raise BackwardError(
                f"post-accumulate-grad hook {name!r} on leaf {leaf.role!r} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if result is not None:
            raise BackwardError(
                f"post-accumulate-grad hook {name!r} on leaf {leaf.role!r} returned "
                f"{result!r:.60}; it must return None (it cannot replace the gradient: use "
                f"register_hook for that)"
            )


class Engine:
    """One backward pass over a planned graph (planning is ``_planning.make_plan``, a pure
    function). Create, ``await run(...)``, read the results. Delivery, the ready queue, the
    runners and the commit share the per-pass state (pending counts, buffers, staged
    grads) that makes the all-or-nothing rule hold.

    ``captures``: when given, only gradients reaching these leaves or these
    ``(node, output_nr)`` pairs are computed (nodes that lead nowhere useful
    never run). ``accumulate``: stage leaves' gradients to be committed into
    ``.grad``; retained non-leaves' are staged in every pass. Committing is the
    caller's choice.
    """

    def __init__(
        self,
        executor: Executor,
        *,
        create_graph: bool,
        keep_graph: bool,
        listeners: Iterable[Listener] = (),
        since: int | None = None,
    ) -> None:
        self.executor = executor
        self._batched = getattr(executor, "run_backward_batched", None)
        # The protocol's submission methods: nodes that wait without a task each (NOTE
        # [Submitted nodes]).
        self._submits = callable(getattr(executor, "submits", None)) and callable(
            getattr(executor, "submit_backward", None)
        )
        # Submitted, not collected: handle -> (node, the node's own context).
        self._flight: dict[Any, tuple[Node, contextvars.Context]] = {}
        self._done = _Completions()
        self._unsent = 0  # nodes submitted since the last send_submitted
        self._collecting = False
        # GradManager's recording window: nodes created before sequence number ``since``
        # are not differentiated through (their gradients may still be captured).
        self._since = since
        self.create_graph = create_graph
        self.keep_graph = keep_graph
        self.listeners = (*_LISTENERS.get(), *listeners)
        self.staged: dict[Variable, Variable] = {}
        self.captured: dict[Variable | tuple[Node, int], Variable | None] = {}
        self._pending: dict[Target, int] = {}
        self._buffers: dict[Target, list[Contribution]] = {}
        self._ready: deque[tuple[Target, list[Contribution]]] = deque()
        self._receives: set[Target] | None = None
        self._capture_nodes: set[Node] = set()
        self._execute: set[Node] | None = None
        self._accumulate = True
        self._error: BaseException | None = None
        self._ran: list[Node] = []
        # Slow nodes waiting for a task, and the runner tasks that take them.
        self._slow: deque[WorkItem] = deque()
        # The batching probe, made once (a bound method would be made per node, and one
        # kept on self would be a reference cycle, leaving the pass to the collector).
        slow = self._slow
        self._more_ready_probe: Callable[[], bool] = lambda: bool(slow)
        self._runners_starting = 0
        self._runners_alive = 0
        # The task group exists only once a pass needs a second task (runners, hooks):
        # a chain runs in the caller's task alone. Until then, tasks to start wait here.
        self._tg: anyio.abc.TaskGroup | None = None
        self._start_soon: Callable[..., object] | None = None  # the task group's
        self._deferred: list[
            tuple[Callable[..., Coroutine[Any, Any, object]], tuple[Any, ...]]
        ] = []
        self._suspended = False

    # -- planning -------------------------------------------------------------
    def _plan(
        self,
        roots: Sequence[tuple[Edge, Variable | None]],
        capture_leaves: Sequence[Variable] | None,
        capture_outputs: Sequence[tuple[Node, int]],
    ) -> None:
        plan = make_plan(roots, capture_leaves, capture_outputs, self._since)
        self._pending = plan.pending
        self._receives = plan.receives
        self._execute = plan.execute
        self._capture_nodes = plan.capture_nodes

    # -- running ----------------------------------------------------------------
    async def run(
        self,
        roots: Sequence[tuple[Edge, Variable | None]],
        *,
        capture_leaves: Sequence[Variable] | None = None,
        capture_outputs: Sequence[tuple[Node, int]] = (),
        accumulate: bool = True,
    ) -> None:
        """Run the pass; raise BackwardError naming the node if any backward failed."""
        observers = _PASS_OBSERVERS.get()
        if observers:
            info = PassInfo(len(roots), self.create_graph, type(self.executor).__name__)
            with ExitStack() as stack:
                for observer in observers:
                    stack.enter_context(observer(info))
                await self._run(roots, capture_leaves, capture_outputs, accumulate)
            return
        await self._run(roots, capture_leaves, capture_outputs, accumulate)

    async def _run(
        self,
        roots: Sequence[tuple[Edge, Variable | None]],
        capture_leaves: Sequence[Variable] | None,
        capture_outputs: Sequence[tuple[Node, int]],
        accumulate: bool,
    ) -> None:
        self._plan(roots, capture_leaves, capture_outputs)
        self._accumulate = accumulate
        token = _GRAD_ENABLED.set(self.create_graph)
        cell: list[Node | None] = [None]  # this task's: see NOTE [Current node]
        cell_token = _CURRENT_NODE.set(cell)
        try:
            for i, ((target, nr), grad) in enumerate(roots):
                self._deliver(target, nr, (_SEED_SEQ, i), grad)
            # In this task alone while the pass is a chain (no task group to open and
            # close: that costs an event-loop pass); the rest in a task group once a
            # node or hook needs a task of its own.
            item = await self._work(await self._drain(cell), cell)
            if item is None and self._deferred == [(self._collect, ())]:
                # Only submitted nodes to wait for: this task collects them itself, until
                # one of them makes work that needs a task (NOTE [Submitted nodes]).
                self._deferred.clear()
                if not await self._collect(cell):
                    self._collecting = True
                    self._deferred.append((self._collect, ()))
            if self._deferred and self._error is None:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    self._start_soon = start_soon = tg.start_soon
                    deferred, self._deferred = self._deferred, []
                    for fn, args in deferred:
                        start_soon(fn, *args)
                    await self._work(item, cell)
                self._suspended = True
            if self._error is None:
                if self._suspended:
                    # A blocking backward may have returned after the caller was cancelled.
                    await anyio.lowlevel.checkpoint_if_cancelled()
                else:
                    # Nothing waited (a graph of inline nodes): still let other tasks run,
                    # so that a loop of backward() calls never starves the event loop.
                    await anyio.lowlevel.checkpoint()
        finally:
            _CURRENT_NODE.reset(cell_token)
            _GRAD_ENABLED.reset(token)
            self._tg = self._start_soon = None
            if self._flight:  # submitted before the pass failed or was cancelled, and its
                # collector never started (NOTE [Submitted nodes])
                await self._abandon()
            self._done.close()
        if self._error is not None:
            raise self._error
        # Free saved variables only now: a pass that failed can be retried.
        for node in self._ran:
            node.release()
        self._ran.clear()

    def _deliver(
        self, target: Target, nr: int, key: tuple[Seq, int], grad: Variable | None
    ) -> None:
        receives = self._receives
        if receives is not None and target not in receives:
            return
        remaining = self._pending[target] - 1
        entry = (key, nr, grad)
        if remaining == 0:
            buffered = self._buffers.pop(target, None)
            if buffered is None:
                self._ready.append((target, [entry]))
            else:
                buffered.append(entry)
                self._ready.append((target, buffered))
        else:
            self._pending[target] = remaining
            buffered = self._buffers.get(target)
            if buffered is None:
                self._buffers[target] = [entry]
            else:
                buffered.append(entry)

    def _deliver_edges(self, node: Node, grads: Sequence[Variable | None]) -> None:
        seq = node.seq
        deliver = self._deliver
        for i, edge in enumerate(node.next_edges):
            if edge is not None:
                deliver(edge[0], edge[1], (seq, i), grads[i])

    async def _drain(self, cell: list[Node | None]) -> WorkItem | None:
        """Process ready targets: inline nodes now, slow ones as tasks.

        Returns one slow node for the calling task to run itself (work-first:
        a chain of async nodes then costs no task spawn per node); every other
        slow node gets a task of its own. Targets with gradient hooks get a task
        too, so an async hook never holds up the rest of the pass. ``cell``: the
        calling task's current-node cell (see NOTE [Current node]).
        """
        ready = self._ready
        keep: WorkItem | None = None
        since_yield = 0
        while ready and self._error is None:
            target, contributions = ready.popleft()
            if target.__class__ is not Node:
                leaf: Variable = target  # type: ignore[assignment]
                if leaf._hooks or (leaf._post_hooks and self._accumulate):
                    self._spawn(self._complete_leaf, leaf, contributions)
                else:
                    await self._complete_leaf(leaf, contributions)
                continue
            node: Node = target
            if node.output_hooks:
                self._spawn(self._hooked_node, node, contributions)
                continue
            grads = self._node_grads(node, contributions)
            if grads is None:
                continue
            item = self._dispatch(node, grads, cell)
            if self._unsent >= _MAX_NEW_RUNNERS:
                # As many as the runners one pass of the loop may start: those leave now
                # (the workers start on them while the rest are encoded), and the loop
                # runs other tasks (heartbeats) meanwhile.
                await self._send_submitted()
                await anyio.lowlevel.checkpoint()
            if item is not None:
                if keep is None:
                    keep = item
                else:
                    self._slow.append(item)
            since_yield += 1
            if since_yield >= _YIELD_EVERY:
                since_yield = 0
                await anyio.lowlevel.checkpoint()
        if self._slow:
            self._grow()
        if self._unsent:
            await self._send_submitted()
        return keep if self._error is None else None

    async def _send_submitted(self) -> None:
        """The nodes submitted since the last send leave together (NOTE [Submitted nodes])."""
        self._unsent = 0
        if self._error is not None:  # the pass failed: they are abandoned (cancelled)
            return
        try:
            await self.executor.send_submitted()  # type: ignore[attr-defined]
        except Exception as exc:  # the protocol says it reports through ``done``: a bug
            if not self._flight:
                raise
            node = next(reversed(self._flight.values()))[0]
            self._fail(node, exc)

    def _submitted(self, node: Node, grads: tuple[Variable | None, ...]) -> bool:
        """Hand ``node`` to the executor's ``submit_backward`` if it takes such nodes (NOTE
        [Submitted nodes]); True when it did, or the submission failed the pass.

        The node gets a context of its own (a copy of this task's, as a task of its own
        would): its "started" listeners, its submission, and later its result and its
        "finished" (or "failed") listeners run in it, so that what a listener sets there
        (a tracing span) is current for the node alone, from start to finish.
        """
        if not self.executor.submits(node):  # type: ignore[attr-defined]
            return False
        context = contextvars.copy_context()
        context.run(self._submit_in_context, node, grads, context)
        if self._flight and not self._collecting:  # started from this task's context
            self._collecting = True
            self._spawn(self._collect)
        return True

    def _submit_in_context(
        self, node: Node, grads: tuple[Variable | None, ...], context: contextvars.Context
    ) -> None:
        # The node's own cell (NOTE [Current node]): current_node() names it in its context
        # from its "started" listeners to its "finished" ones, whichever task runs them.
        _CURRENT_NODE.set([node])
        if self.listeners:
            self._emit("started", node, grads=grads)
        try:
            handle = self.executor.submit_backward(node, grads, self._done)  # type: ignore[attr-defined]
        except Exception as exc:
            self._fail(node, exc)
            return
        self._suspended = True
        self._unsent += 1
        self._flight[handle] = (node, context)

    def _collected(self, node: Node, handle: Any) -> None:
        """Finish a submitted node whose outcome is in (in its own context)."""
        try:
            grads_in = normalize_grads(node, self.executor.collect_backward(handle))  # type: ignore[attr-defined]
        except Exception as exc:
            self._fail(node, exc)
            return
        self._finish(node, grads_in)

    async def _collect(self, cell: list[Node | None] | None = None) -> bool:
        """Finish the submitted nodes as their outcomes come (NOTE [Submitted nodes]); if the
        pass ends first (failed, cancelled), abandon those still out.

        In a task of its own (``cell`` None), until none is out. Given the pass's own task's
        ``cell`` (before the task group exists), only until something waits for a task:
        False then, with nodes still out, for a task of the group to collect them.
        """
        if cell is None:
            cell = [None]  # this task's own: see NOTE [Current node]
            _CURRENT_NODE.set(cell)
            alone = False
        else:
            alone = True
        done = self._done
        handed_over = False
        try:
            while self._flight and self._error is None:
                if alone and self._deferred:
                    handed_over = True
                    return False
                if not done.ready:
                    done.wakeup = anyio.Event()
                    await done.wakeup.wait()
                ready, done.ready = done.ready, []
                for handle in ready:
                    entry = self._flight.pop(handle, None)
                    if entry is None:
                        continue
                    node, context = entry
                    context.run(self._collected, node, handle)
                    if self._error is not None:
                        return True
                item = await self._drain(cell)
                if item is not None:
                    self._slow.append(item)
                    self._grow()
            return True
        finally:
            self._collecting = False
            if self._flight and not handed_over:
                await self._abandon()

    async def _abandon(self) -> None:
        """The pass ends with submitted nodes still out: the executor cancels them."""
        flight, self._flight = list(self._flight), {}
        with anyio.CancelScope(shield=True):
            try:
                await self.executor.abandon_submitted(flight)  # type: ignore[attr-defined]
            except Exception:  # the pass ends with its own error (or cancellation)
                _log.exception("abandoning %d submitted node(s) failed", len(flight))

    def _grow(self) -> None:
        """Start runner tasks for waiting slow nodes, doubling the pool while it is short.

        A runner takes slow nodes one after another. New runners are started only
        when none is still starting: nodes that never suspend are then run by the
        few runners there are (no task per node), while nodes that wait (an LLM
        call) make every runner busy, so the pool doubles each time a runner
        starts until every waiting node has one. At most ``_MAX_NEW_RUNNERS`` start
        in one pass of the event loop: each starts its node there, and thousands at once
        would hold the loop for as long as they take (other tasks and timers wait for the
        next pass). Submitted nodes (NOTE [Submitted nodes]) need no runner; ``_drain``
        lets the loop run after each ``_MAX_NEW_RUNNERS`` of them.
        """
        if self._runners_starting:
            return
        want = min(len(self._slow), max(2, self._runners_alive), _MAX_NEW_RUNNERS)
        for _ in range(want):
            self._runners_starting += 1
            self._runners_alive += 1
            self._spawn(self._runner)

    async def _runner(self) -> None:
        self._runners_starting -= 1
        cell: list[Node | None] = [None]  # this task's own: see NOTE [Current node]
        _CURRENT_NODE.set(cell)
        try:
            ran = 0
            while self._slow and self._error is None:
                item = self._slow.popleft()
                if self._slow:
                    self._grow()
                await self._work(item, cell)
                ran += 1
                if ran % _YIELD_EVERY == 0:
                    await anyio.lowlevel.checkpoint()
        finally:
            self._runners_alive -= 1

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, object]], *args: Any) -> None:
        if self._start_soon is None:
            self._deferred.append((fn, args))  # started once run() opens the task group
        else:
            self._start_soon(fn, *args)

    def _dispatch(
        self, node: Node, grads: tuple[Variable | None, ...], cell: list[Node | None]
    ) -> WorkItem | None:
        """Run ``node`` now if its backward is inline; else return it as work for a task.

        ``cell``: this task's current-node cell (see NOTE [Current node]).
        """
        if all(g is None for g in grads):
            self._deliver_edges(node, (None,) * len(node.next_edges))
            return None
        try:
            if not self.executor.inline(node):
                if self._submits and self._submitted(node, grads):
                    return None
                return (node, grads)
            if self.listeners:
                self._emit("started", node, grads=grads)
            cell[0] = node
            try:
                grads_in = normalize_grads(node, node.function.backward(node.ctx, *grads))
            finally:
                cell[0] = None
        except Exception as exc:
            self._fail(node, exc)
            return None
        self._finish(node, grads_in)
        return None

    async def _work(self, item: WorkItem | None, cell: list[Node | None]) -> WorkItem | None:
        """Run slow nodes one after another, as long as each makes another one ready.

        Before the task group exists, stops when a task must be started and returns
        the node it would have run next (None when the pass is over or failed).
        ``cell``: the calling task's current-node cell (see NOTE [Current node]).
        """
        ran = 0
        while item is not None:
            if self._deferred and self._tg is None:
                return item
            node, grads = item
            ran += 1
            if ran % _YIELD_EVERY == 0:
                await anyio.lowlevel.checkpoint()  # async backwards that never suspend
            if self.listeners:
                self._emit("started", node, grads=grads)
            self._suspended = True
            cell[0] = node
            try:
                if self._batched is not None:  # the protocol's optional batching method
                    result = await self._batched(node, grads, self._more_ready_probe)
                else:
                    result = await self.executor.run_backward(node, grads)
                grads_in = normalize_grads(node, result)
            except Exception as exc:
                self._fail(node, exc)
                return None
            finally:
                cell[0] = None
            self._finish(node, grads_in)
            item = await self._drain(cell)
        return None

    async def _hooked_node(self, node: Node, contributions: list[Contribution]) -> None:
        cell: list[Node | None] = [None]  # this task's own: see NOTE [Current node]
        _CURRENT_NODE.set(cell)
        grads = self._node_grads(node, contributions, defer_post=True)
        if grads is None:
            return
        hooked = list(grads)
        # A node none of whose outputs got a gradient does not run, nor do its hooks; when
        # it runs, the hooks of an output that got none see None (PyTorch's tensor hooks).
        runs = any(g is not None for g in hooked)
        for nr, hooks in (node.output_hooks or {}).items():
            if runs and hooks:
                role = node.output_roles[nr] if nr < len(node.output_roles) else ""
                try:
                    hooked[nr] = await run_hooks(hooks, hooked[nr], role)
                except BackwardError as exc:
                    self._fail(node, exc)
                    return
        final = self._post_node(node, hooked)
        if final is None:
            return
        item = self._dispatch(node, final, cell)
        await self._work(item if item is not None else await self._drain(cell), cell)

    def _finish(self, node: Node, grads_in: tuple[Variable | None, ...]) -> None:
        if self.listeners:
            self._emit("finished", node)
        if not self.keep_graph:
            self._ran.append(node)
        self._deliver_edges(node, grads_in)

    def _node_grads(
        self, node: Node, contributions: list[Contribution], *, defer_post: bool = False
    ) -> tuple[Variable | None, ...] | None:
        """Sum a node's incoming gradients per output (then retain and capture them)."""
        n = node.num_outputs
        if len(contributions) > 1:
            contributions.sort(key=_key)
        try:
            if n == 1:
                if len(contributions) == 1:
                    grads: list[Variable | None] = [contributions[0][2]]
                else:
                    grads = [sum_grads([c[2] for c in contributions], self.create_graph)]
            else:
                per_output: list[list[Variable | None]] = [[] for _ in range(n)]
                for _, nr, g in contributions:
                    per_output[nr].append(g)
                grads = [sum_grads(gs, self.create_graph) for gs in per_output]
        except Exception as exc:  # e.g. text and numbers flowing into one output
            error = BackwardError(
                f"cannot sum the gradients flowing into the outputs of {node.describe()}: "
                f"{type(exc).__name__}: {exc}",
                function=node.name,
                input_roles=node.input_roles,
                output_roles=node.output_roles,
            )
            error.__cause__ = exc
            self._fail(node, error)
            return None
        if defer_post:
            return tuple(grads)
        return self._post_node(node, grads)

    def _post_node(
        self, node: Node, grads: list[Variable | None]
    ) -> tuple[Variable | None, ...] | None:
        """Retain and capture a node's output gradients; None if its backward need not run."""
        # retain_grad() fills .grad in every pass that reaches the node (grad() and
        # GradManager passes too), as PyTorch's retains_grad hooks.
        if node.retained:
            for nr, ref in node.retained.items():
                var = ref()
                g = grads[nr]
                if var is not None and g is not None:
                    self.stage(var, g)
        if node in self._capture_nodes:
            for nr in range(node.num_outputs):
                self.captured[(node, nr)] = grads[nr]
        if self._execute is not None and node not in self._execute:
            return None  # captured only: nothing downstream needs its backward
        # Zeros for the outputs that got none, when some got one: a node that got none
        # at all is skipped (``_dispatch``), as in PyTorch.
        if node.zeros is not None and None in grads and any(g is not None for g in grads):
            grads = [
                g if g is not None or z is None else Variable(make_zero(z))
                for g, z in zip(grads, node.zeros, strict=True)
            ]
        return tuple(grads)

    async def _complete_leaf(self, leaf: Variable, contributions: list[Contribution]) -> None:
        if len(contributions) == 1:
            grad = contributions[0][2]
        else:
            contributions.sort(key=_key)
            try:
                grad = sum_grads([c[2] for c in contributions], self.create_graph)
            except Exception as exc:  # e.g. text and numbers flowing into one leaf
                error = BackwardError(
                    f"cannot sum the gradients flowing into leaf {leaf!r} (role "
                    f"{leaf.role!r}): {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                self._fail_leaf(leaf, error)
                return
        if grad is None:
            return
        if leaf._hooks:
            try:
                hooked = await run_hooks(leaf._hooks, grad, leaf.role)
            except BackwardError as exc:
                self._fail_leaf(leaf, exc)
                return
            assert hooked is not None  # a hook replaces a gradient, never removes it
            grad = hooked
        self.captured[leaf] = grad
        if self._accumulate:
            grad = self.stage(leaf, grad)
            if leaf._post_hooks:
                try:
                    await run_post_hooks(leaf._post_hooks, leaf, grad)
                except BackwardError as exc:
                    self._fail_leaf(leaf, exc)

    # -- failure and events ---------------------------------------------------
    def _fail(self, node: Node, exc: Exception) -> None:
        if self._error is not None:
            return
        if isinstance(exc, BackwardError) and exc.function:
            error: BackwardError = exc
        else:
            error = BackwardError(
                f"backward of {node.describe()} failed: {type(exc).__name__}: {exc}",
                function=node.name,
                input_roles=node.input_roles,
                output_roles=node.output_roles,
            )
            error.__cause__ = exc
        self._error = error
        if self.listeners:
            self._emit("failed", node, exc)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    def _fail_leaf(self, leaf: Variable, exc: BackwardError) -> None:
        if self._error is None:
            self._error = exc
            if self._tg is not None:
                self._tg.cancel_scope.cancel()

    def _emit(
        self,
        kind: Literal["started", "finished", "failed"],
        node: Node,
        error: BaseException | None = None,
        *,
        grads: tuple[Variable | None, ...] = (),
    ) -> None:
        event = NodeEvent(
            kind,
            node.name,
            node.input_roles,
            node.output_roles,
            node.seq,
            time.perf_counter(),
            error,
            node,
            grads,
        )
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # an observer must not break the computation it observes
                _log.exception("backward listener %r raised on %s", listener, event)

    # -- committing -------------------------------------------------------------
    def stage(self, var: Variable, grad: Variable) -> Variable:
        """Stage ``grad`` for ``var``'s ``.grad`` (a copy of its own: ``own_grad``); return it.

        The one way into ``.grad``: ``backward``, ``grad`` (retained variables),
        ``GradManager.backward`` and the engine's own leaves and retained variables stage
        here and write with :meth:`commit`, so a ``.grad`` never shares its object with a
        caller's gradient or another variable's. A variable has one gradient per pass:
        staging it again (retained and among ``inputs=``, say) replaces, never adds.
        """
        owned = own_grad(grad, self.create_graph)
        self.staged[var] = owned
        return owned

    def commit(self) -> None:
        """Write staged gradients into ``.grad`` (existing gradient first, then new).

        As PyTorch's AccumulateGrad: without create_graph, onto an existing ``.grad``
        that has no history the sum is written in place (a reference to ``x.grad``
        taken before sees it); otherwise ``.grad`` becomes a new Variable.
        """
        # Sum everything first: if one sum fails, no .grad has changed.
        updates: list[tuple[Variable, Variable]] = []
        in_place: list[tuple[Variable, Any]] = []
        for var, grad in self.staged.items():
            old = var.grad
            if old is None:
                updates.append((var, grad))
            elif self.create_graph or old.grad_fn is not None or old.requires_grad:
                total = sum_grads([old, grad], self.create_graph)
                assert total is not None
                updates.append((var, total))
            else:
                in_place.append((old, accumulate(old.data, grad.data)))
        for var, total in updates:
            var.grad = total
        for old, data in in_place:
            old.data = data
