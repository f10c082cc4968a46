"""Shared by the observe tests: a Trace Event Format checker and small Functions."""

from __future__ import annotations

import json
from typing import Any

import anyio

from asyncgraph import Function, Variable
from asyncgraph.models import SimulatedModel

METADATA_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_chrome_trace(trace: Any) -> list[dict[str, Any]]:
    """Assert ``trace`` is Trace Event Format JSON as Perfetto reads it; its "X" events.

    Top level: ``traceEvents`` (a list) and ``displayTimeUnit``. Every "X" event has a
    name, a category, ``ts`` and ``dur`` >= 0 in microseconds, int ``pid`` / ``tid`` and
    an ``args`` map; every row it uses is named by a ``thread_name`` metadata event, every
    process by ``process_name``. Events on one row nest properly (Perfetto's rule for
    complete events on a thread).
    """
    trace = json.loads(json.dumps(trace))  # JSON data only
    assert isinstance(trace, dict)
    assert trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list)
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(complete) + len(meta) == len(events), {e["ph"] for e in events}
    threads = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    processes = {e["pid"] for e in meta if e["name"] == "process_name"}
    for e in meta:
        assert e["name"] in METADATA_NAMES
        assert isinstance(e["args"], dict)
    for e in complete:
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["cat"], str)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["args"], dict)
        assert (e["pid"], e["tid"]) in threads
        assert e["pid"] in processes
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in complete:
        rows.setdefault((e["pid"], e["tid"]), []).append(e)
    for row in rows.values():
        open_ends: list[float] = []
        for e in sorted(row, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, "rows must nest"
            open_ends.append(e["ts"] + e["dur"])
    return complete


class Sleep(Function):
    """Identity whose backward sleeps ``ctx.delay_s`` (a stand-in for an LLM call)."""

    @staticmethod
    def forward(ctx: Any, x: Variable, delay_s: float) -> Any:
        ctx.delay_s = delay_s
        return x.data

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        await anyio.sleep(ctx.delay_s)
        return g, None  # delay_s is an input too


class Total(Function):
    """Sum of numbers (a fan-in): every input gets the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, *xs: Variable) -> Any:
        return sum(x.data for x in xs)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, ...]:
        return tuple(g for _ in ctx.needs_input_grad)


MODEL = SimulatedModel(latency_s=0.02, responder=lambda messages: "be shorter", tag_replies=False)


class Critique(Function):
    """Text identity whose backward asks ``MODEL`` for feedback (``ctx.calls`` at once)."""

    @staticmethod
    def forward(ctx: Any, answer: Variable, calls: int = 1) -> Variable:
        ctx.calls = calls
        return Variable(answer.data.upper(), role="shouted answer")

    @staticmethod
    async def backward(ctx: Any, feedback: Variable) -> Any:
        replies: list[str] = []

        async def ask() -> None:
            reply = await MODEL.complete([{"role": "user", "content": f"critique {feedback.data}"}])
            replies.append(reply.text)

        async with anyio.create_task_group() as tg:
            for _ in range(ctx.calls):
                tg.start_soon(ask)
        rest = (None,) * (len(ctx.needs_input_grad) - 1)  # calls=, when given
        return (" / ".join(replies), *rest)
