"""Timelines of passes as Chrome / Perfetto traces: schema, lanes, nesting, failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph import BackwardError, Function, Parameter, Variable
from asyncgraph.observe import Span, Timeline, trace_pass
from asyncgraph.observe._timeline import assign_lanes, current_timeline
from asyncgraph.text import concat

from .observe_helpers import Critique, Sleep, Total, check_chrome_trace

pytestmark = pytest.mark.anyio


async def test_fan_in_of_16_async_nodes_shows_16_overlapping_spans_on_16_rows(
    tmp_path: Path,
) -> None:
    leaves = [Variable(float(i), role=f"x{i}", requires_grad=True) for i in range(16)]
    total = Total.apply(*[Sleep.apply(x, delay_s=0.05) for x in leaves])
    path = tmp_path / "pass.json"
    async with trace_pass(path) as timeline:
        await total.backward()
    assert current_timeline() is None
    events = check_chrome_trace(json.loads(path.read_text()))
    sleeps = [e for e in events if e["name"] == "Sleep"]
    assert len(sleeps) == 16
    assert all(e["cat"] == "node" for e in sleeps)
    # They overlap in time: each starts before any of them ends...
    assert max(e["ts"] for e in sleeps) < min(e["ts"] + e["dur"] for e in sleeps)
    assert all(e["dur"] >= 45_000 for e in sleeps)  # microseconds: each slept 50 ms
    # ... so each has a row of its own, named for Perfetto.
    assert len({e["tid"] for e in sleeps}) == 16
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in json.loads(path.read_text())["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert all(names[(e["pid"], e["tid"])].startswith("lane ") for e in sleeps)
    assert timeline.trace_id == json.loads(path.read_text())["otherData"]["trace_id"]


async def test_nodes_that_run_one_after_another_share_a_row() -> None:
    x = Variable(1.0, requires_grad=True)
    y = Sleep.apply(Sleep.apply(Sleep.apply(x, delay_s=0.01), delay_s=0.01), delay_s=0.01)
    async with trace_pass() as timeline:
        await y.backward()
    events = check_chrome_trace(timeline.to_chrome_trace())
    assert len(events) == 3
    assert {e["tid"] for e in events} == {1}


async def test_model_calls_nest_inside_their_node_and_a_concurrent_second_call_gets_a_row() -> None:
    answers = [Parameter(f"answer {i}", role="answer") for i in range(2)]
    report = concat(Critique.apply(answers[0], calls=1), Critique.apply(answers[1], calls=2))
    async with trace_pass() as timeline:
        await report.backward()
    events = check_chrome_trace(timeline.to_chrome_trace())
    one, two = sorted(
        (e for e in events if e["name"] == "Critique"), key=lambda e: e["args"]["seq"]
    )
    calls = [e for e in events if e["cat"] == "model"]
    assert len(calls) == 3
    assert all(c["args"]["node"] == "Critique" for c in calls)

    def inside(call: dict[str, Any], node: dict[str, Any]) -> bool:
        return (
            call["args"]["node_seq"] == node["args"]["seq"]
            and node["ts"] <= call["ts"]
            and call["ts"] + call["dur"] <= node["ts"] + node["dur"]
        )

    # Each call happened within its node's time; one call per node sits on the node's row
    # (drawn nested in it), the second node's concurrent second call on a row of its own.
    assert sum(inside(c, one) for c in calls) == 1
    assert sum(inside(c, two) for c in calls) == 2
    assert [inside(c, one) for c in calls if c["tid"] == one["tid"]] == [True]
    assert [inside(c, two) for c in calls if c["tid"] == two["tid"]] == [True]
    assert len({c["tid"] for c in calls}) == 3
    assert all(c["args"]["model"] == "simulated" for c in calls)
    assert all(c["args"]["prompt_tokens"] > 0 for c in calls)


class Boom(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        await anyio.sleep(0.01)
        raise ValueError("judge unavailable")


async def test_a_failed_node_is_marked_and_the_cancelled_ones_too(tmp_path: Path) -> None:
    x = Variable(1.0, requires_grad=True)
    total = Total.apply(Boom.apply(x), Sleep.apply(x, delay_s=5.0))
    path = tmp_path / "failed.json"
    with pytest.raises(BackwardError):
        async with trace_pass(path):
            await total.backward()
    events = check_chrome_trace(json.loads(path.read_text()))
    boom = next(e for e in events if e["name"] == "Boom")
    sleep = next(e for e in events if e["name"] == "Sleep")
    assert boom["args"]["status"] == "failed"
    assert "ValueError: judge unavailable" in boom["args"]["error"]
    assert sleep["args"]["status"] == "cancelled"
    assert sleep["dur"] < 4_000_000


async def test_phases_go_on_row_0_and_spans_added_for_a_worker_get_their_own_process() -> None:
    timeline = Timeline(name="step 1")
    with timeline.recording():
        with timeline.phase("backward"):
            x = Variable(1.0, requires_grad=True)
            await Sleep.apply(x, delay_s=0.01).backward()
    start = timeline.spans[0].start_s
    timeline.add_span("node", "Critique", start, start + 0.01, process="worker-a:77", key=(99,))
    trace = timeline.to_chrome_trace()
    events = check_chrome_trace(trace)
    phase = next(e for e in events if e["cat"] == "phase")
    assert phase["tid"] == 0 and phase["name"] == "backward"
    remote = next(e for e in events if e["name"] == "Critique")
    local = next(e for e in events if e["name"] == "Sleep")
    assert remote["pid"] != local["pid"]
    process_names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert process_names[remote["pid"]] == "worker worker-a:77"
    assert process_names[local["pid"]].endswith("(this process)")


def test_trace_pass_works_as_a_sync_context_manager_around_a_run(tmp_path: Path) -> None:
    path = tmp_path / "sync.json"

    async def main() -> None:
        x = Variable(1.0, requires_grad=True)
        await Sleep.apply(x, delay_s=0.0).backward()

    with trace_pass(path) as timeline:
        anyio.run(main)
    assert [s.name for s in timeline.spans] == ["Sleep"]
    assert check_chrome_trace(json.loads(path.read_text()))


def test_assign_lanes_reuses_rows_and_nests_calls_in_their_node() -> None:
    spans = [
        Span("node", "a", 0.0, 1.0, key=(1,)),
        Span("node", "b", 0.5, 2.0, key=(2,)),
        Span("model", "call a", 0.1, 0.9, parent=(1,)),
        Span("model", "call a2", 0.2, 0.8, parent=(1,)),  # concurrent with "call a"
        Span("node", "c", 1.0, 1.5, key=(3,)),  # starts as "a" ends: reuses its row
        Span("model", "orphan", 1.6, 1.7),
    ]
    rows = assign_lanes(spans)
    assert rows[0] == 1 and rows[2] == 1  # the call sits in its node's row
    assert rows[3] == 2  # the node's second, concurrent call: the first free row
    assert rows[1] == 3  # "b" overlaps both
    assert rows[4] == 1
    assert rows[5] == 1


def test_a_trace_pass_cannot_be_entered_twice() -> None:
    tracer = trace_pass()
    with tracer, pytest.raises(RuntimeError, match="already open"):
        tracer.__enter__()


def test_every_public_name_of_observe_is_exported_sorted_and_documented() -> None:
    import asyncgraph.observe as observe

    assert observe.__all__ == sorted(observe.__all__)
    for name in observe.__all__:
        assert getattr(observe, name).__doc__, name
