"""Timelines of backward passes, written as Chrome / Perfetto trace JSON.

A ``Timeline`` records spans: one per node backward (from the engine's
``NodeEvent``s), one per model call (from ``asyncgraph.models.observe_calls``, tied
to the node it ran in through ``asyncgraph.current_node()``) and the phases a caller
marks (a job's forward, backward, optimizer step). ``to_chrome_trace()`` lays them out
in the Trace Event Format that https://ui.perfetto.dev and chrome://tracing open:

- one process track per place work ran: this process, and (once the distributed
  executor reports them) each worker, keyed by ``Span.process``;
- in each, one row (thread track) per concurrent lane: spans that overlap in time
  get different rows, so a fan-in of 16 concurrent nodes shows 16 rows; row 0 holds
  the phases;
- a model call sits inside its node's span on the node's row (Perfetto draws it
  nested below); a node's second concurrent call goes to a row of its own.

Times are ``time.perf_counter()`` seconds, written as microseconds since the timeline
started; ``started_at`` (the wall clock then) is in the file's ``otherData``, which is
what spans from another machine are aligned with.
"""

from __future__ import annotations

import contextvars
import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import anyio.to_thread

from asyncgraph import NodeEvent, Variable, current_node, observe_nodes
from asyncgraph._files import write_private_json

from ..models import ModelCall, observe_calls
from ._context import PROCESS, current_labels

Seq = tuple[int, ...]  # a node's order key (asyncgraph.Node.seq)

__all__ = ["Span", "Timeline", "assign_lanes", "current_timeline", "trace_pass"]

SpanKind = Literal["node", "model", "phase"]

_TIMELINE: contextvars.ContextVar[Timeline | None] = contextvars.ContextVar(
    "asyncgraph_timeline", default=None
)


@dataclass(slots=True, eq=False)
class Span:
    """One interval of a timeline.

    ``kind``: ``"node"`` (a node's backward, keyed by the node's ``seq``), ``"model"``
    (a model call; ``parent`` is the ``seq`` of the node it ran in, if any) or
    ``"phase"``. ``process`` names where it ran (``PROCESS`` for this one, a worker's
    name for a remote node's work). ``end_s`` is None while it runs. ``status``:
    ``"ok"``, ``"failed"`` or ``"cancelled"`` (still running when the timeline closed).

    Example::

        async with trace_pass() as timeline:
            await loss.backward()
        for span in timeline.spans:
            print(span.kind, span.name, span.status, span.end_s - span.start_s)
    """

    kind: SpanKind
    name: str
    start_s: float
    end_s: float | None = None
    process: str = PROCESS
    key: Seq | None = None
    parent: Seq | None = None
    status: str = "ok"
    args: dict[str, Any] = field(default_factory=dict)
    grads: tuple[Variable | None, ...] = ()
    roles: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # a node's inputs, outputs


def assign_lanes(spans: Sequence[Span]) -> list[int]:
    """The row of each span (within its process): overlapping spans get different rows.

    Greedy interval partitioning in start order, rows numbered from 1 (row 0 is for
    phases, which are not assigned here). A model call goes on its node's row when it
    fits inside the node there (no other call of that node open on it), else on the
    first row free at its start, like a node. All spans must have an end.
    """
    lanes: dict[str, list[list[int]]] = {}  # process -> rows -> stack of open span indices
    row_of_node: dict[tuple[str, Seq], int] = {}
    rows = [0] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_s, -_end(spans[i])))
    for i in order:
        span = spans[i]
        stacks = lanes.setdefault(span.process, [])
        start, end = span.start_s, _end(span)
        for stack in stacks:
            while stack and _end(spans[stack[-1]]) <= start:
                stack.pop()
        row = -1
        if span.kind == "model" and span.parent is not None:
            home = row_of_node.get((span.process, span.parent))
            if home is not None:
                stack = stacks[home]
                top = spans[stack[-1]] if stack else None
                if (
                    top is not None
                    and top.kind == "node"
                    and top.key == span.parent
                    and top.start_s <= start
                    and end <= _end(top)
                ):
                    row = home
        if row < 0:
            row = next((r for r, stack in enumerate(stacks) if not stack), -1)
            if row < 0:
                stacks.append([])
                row = len(stacks) - 1
        stacks[row].append(i)
        rows[i] = row + 1
        if span.kind == "node" and span.key is not None:
            row_of_node[(span.process, span.key)] = row
    return rows


def _end(span: Span) -> float:
    return span.start_s if span.end_s is None else span.end_s


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Timeline:
    """Spans of backward passes and model calls; see the module docstring.

    Record with ``with timeline.recording():`` (or ``trace_pass``), or hand
    ``timeline.on_node`` to ``backward(listeners=[...])`` and ``timeline.on_call`` to
    ``asyncgraph.models.observe_calls``. Other recorders (a distributed executor
    reporting a worker's timings) call ``add_span``. ``write(path)`` saves the trace.
    Listeners and observers are called on the event loop; the span list is only
    appended to, so recording from a thread is safe too.

    Example::

        timeline = Timeline()
        with timeline.recording():
            await loss.backward()
        timeline.write("pass.json")           # open it at https://ui.perfetto.dev
    """

    def __init__(self, *, name: str = "asyncgraph", trace_id: str | None = None) -> None:
        self.name = name
        self.trace_id = trace_id or secrets.token_hex(16)
        self.origin_s = time.perf_counter()
        self.started_at = time.time()
        self.spans: list[Span] = []
        self._open: dict[Seq, Span | list[Span]] = {}
        self._lock = threading.Lock()

    # -- recording ------------------------------------------------------------------
    def on_node(self, event: NodeEvent) -> None:
        """A backward listener: opens a node's span on "started", closes it after."""
        # The hot path of a traced pass (twice per node): no lock, no copies. Events come
        # from the event loop's thread, and list/dict operations are atomic under the GIL.
        seq = event.seq
        if event.kind == "started":
            span = Span("node", event.function, event.time_s, key=seq, grads=event.grads)
            span.roles = (event.input_roles, event.output_roles)
            self.spans.append(span)
            already = self._open.get(seq)
            if already is None:
                self._open[seq] = span
            else:  # the same node in two concurrent passes (retain_graph): first in, first out
                self._open[seq] = [*(already if isinstance(already, list) else [already]), span]
            return
        waiting = self._open.pop(seq, None)
        if waiting is None:
            return
        if isinstance(waiting, list):
            done = waiting.pop(0)
            if waiting:
                self._open[seq] = waiting if len(waiting) > 1 else waiting[0]
        else:
            done = waiting
        done.end_s = event.time_s
        if event.kind == "failed":
            done.status = "failed"
            if event.error is not None:
                done.args["error"] = _short(f"{type(event.error).__name__}: {event.error}")

    def on_call(self, call: ModelCall) -> None:
        """A model call observer: a span inside the node it ran in (if any)."""
        node = current_node()
        args: dict[str, Any] = {
            "model": call.model,
            "prompt_tokens": call.prompt_tokens,
            "completion_tokens": call.completion_tokens,
            "cached": call.cached,
            "attempts": call.attempts,
            "cost_usd": call.cost_usd,
        }
        if call.finish_reason is not None:
            args["finish_reason"] = call.finish_reason
        labels = current_labels()
        if labels:
            args["labels"] = dict(labels)
        if node is not None:
            args["node"] = node.name
            args["node_seq"] = list(node.seq)
        span = Span(
            "model",
            f"model {call.model}",
            call.started_s,
            call.started_s + call.latency_s,
            parent=None if node is None else node.seq,
            status="ok" if call.error is None else "failed",
            args=args,
        )
        if call.error is not None:
            args["error"] = _short(call.error)
        with self._lock:
            self.spans.append(span)

    def add_span(
        self,
        kind: SpanKind,
        name: str,
        start_s: float,
        end_s: float | None,
        *,
        process: str = PROCESS,
        key: Seq | None = None,
        parent: Seq | None = None,
        status: str = "ok",
        args: Mapping[str, Any] | None = None,
    ) -> Span:
        """Add a span recorded elsewhere (times in this process's ``perf_counter`` seconds)."""
        span = Span(kind, name, start_s, end_s, process, key, parent, status, dict(args or {}))
        with self._lock:
            self.spans.append(span)
        return span

    @contextmanager
    def phase(self, name: str, **args: Any) -> Iterator[Span]:
        """A span on the phases row around the block (``"forward"``, ``"backward"``, ...)."""
        span = self.add_span("phase", name, time.perf_counter(), None, args=args)
        try:
            yield span
        except BaseException:
            span.status = "failed"
            raise
        finally:
            span.end_s = time.perf_counter()

    @contextmanager
    def recording(self) -> Iterator[Self]:
        """Record every pass and model call inside the block (this task and its children)."""
        with ExitStack() as stack:
            stack.enter_context(observe_nodes(self.on_node))
            stack.enter_context(observe_calls(self.on_call))
            token = _TIMELINE.set(self)
            stack.callback(_TIMELINE.reset, token)
            yield self

    def close(self) -> None:
        """End the spans still open (cancelled nodes, an unfinished phase) at this moment."""
        now = time.perf_counter()
        with self._lock:
            for span in self.spans:
                if span.end_s is None:
                    span.end_s = now
                    if span.kind == "node":
                        span.status = "cancelled"
            self._open.clear()

    # -- reading ----------------------------------------------------------------------
    def node_spans(self) -> dict[Seq, Span]:
        """The last span of each node, by ``seq`` (what ``draw_graph`` marks)."""
        return {s.key: s for s in self.spans if s.kind == "node" and s.key is not None}

    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline in the Trace Event Format (a JSON-ready dict); see the module doc."""
        with self._lock:
            spans = list(self.spans)
        now = time.perf_counter()
        ended = [
            s if s.end_s is not None else _copy_ended(s, now) for s in spans if s.kind != "phase"
        ]
        rows = assign_lanes(ended)
        processes = sorted({s.process for s in spans}, key=lambda p: (p != PROCESS, p))
        pid_of = {p: i + 1 for i, p in enumerate(processes)}
        events: list[dict[str, Any]] = []
        for process, pid in pid_of.items():
            label = f"{process} (this process)" if process == PROCESS else f"worker {process}"
            events.append(_meta("process_name", pid, None, {"name": label}))
            events.append(_meta("process_sort_index", pid, None, {"sort_index": pid}))
        used_rows: set[tuple[int, int]] = set()
        for span in spans:
            if span.kind == "phase":
                pid = pid_of[span.process]
                used_rows.add((pid, 0))
                events.append(self._event(span, pid, 0, now))
        for span, row in zip(ended, rows, strict=True):
            pid = pid_of[span.process]
            used_rows.add((pid, row))
            events.append(self._event(span, pid, row, now))
        for pid, row in sorted(used_rows):
            name = "phases" if row == 0 else f"lane {row}"
            events.append(_meta("thread_name", pid, row, {"name": name}))
            events.append(_meta("thread_sort_index", pid, row, {"sort_index": row}))
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "asyncgraph_trace": 1,
                "name": self.name,
                "trace_id": self.trace_id,
                "started_at": self.started_at,
                "process": PROCESS,
            },
        }

    def _event(self, span: Span, pid: int, tid: int, now: float) -> dict[str, Any]:
        end = span.end_s if span.end_s is not None else now
        args = dict(span.args)
        if span.status != "ok":
            args["status"] = span.status
        if span.roles is not None:
            args["inputs"], args["outputs"] = list(span.roles[0]), list(span.roles[1])
        if span.key is not None:
            args["seq"] = list(span.key)
        return {
            "name": span.name,
            "cat": span.kind,
            "ph": "X",
            "ts": round((span.start_s - self.origin_s) * 1e6, 3),
            "dur": round(max(0.0, end - span.start_s) * 1e6, 3),
            "pid": pid,
            "tid": tid,
            "args": args,
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_chrome_trace()`` to ``path`` (directories created); returns the path."""
        return write_private_json(path, self.to_chrome_trace())

    def __repr__(self) -> str:
        return f"Timeline({self.name!r}, {len(self.spans)} spans, trace_id={self.trace_id!r})"


def _copy_ended(span: Span, now: float) -> Span:
    status = "cancelled" if span.kind == "node" else span.status
    return Span(
        span.kind,
        span.name,
        span.start_s,
        now,
        span.process,
        span.key,
        span.parent,
        status,
        span.args,
        span.grads,
        span.roles,
    )


def _meta(name: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def current_timeline() -> Timeline | None:
    """The timeline recording in this context (``trace_pass``, ``recording()``), or None."""
    return _TIMELINE.get()


class trace_pass:  # a context manager used like a function, as open() is
    """Record a timeline of the passes (and model calls) in the block; write it at the end.

    ``with trace_pass("pass.json") as timeline:`` or ``async with`` (which writes the
    file in a worker thread, off the event loop). Every ``backward`` / ``grad`` and
    model call in the block, in this task and the tasks it starts, is recorded; the
    file (Chrome / Perfetto trace JSON: open it at https://ui.perfetto.dev) is written
    when the block ends, also when it raises (failed nodes are marked, cancelled ones
    end where the block did). ``path=None`` only records: read ``timeline`` (and
    ``timeline.write(path)`` later)::

        async with trace_pass("pass.json"):
            await loss.backward()
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        timeline: Timeline | None = None,
        name: str = "asyncgraph pass",
    ) -> None:
        self.path = None if path is None else Path(path)
        self.timeline = timeline if timeline is not None else Timeline(name=name)
        self._stack: ExitStack | None = None

    def __enter__(self) -> Timeline:
        if self._stack is not None:
            raise RuntimeError("this trace_pass is already open; create one per block")
        self._stack = ExitStack()
        self._stack.enter_context(self.timeline.recording())
        return self.timeline

    def _exit(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        self.timeline.close()

    def __exit__(self, *exc_info: object) -> None:
        self._exit()
        if self.path is not None:
            self.timeline.write(self.path)

    async def __aenter__(self) -> Timeline:
        return self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        self._exit()
        if self.path is not None:
            path, timeline = self.path, self.timeline
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(timeline.write, path)
