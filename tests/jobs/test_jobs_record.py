"""What a job writes for the dashboard: steps.jsonl, per-step traces, the call log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# tests/ is on sys.path (pytest's rootdir-relative imports): the observe tests' checker.
from observe.observe_helpers import check_chrome_trace

from asyncgraph.jobs import run_job
from asyncgraph.jobs._record import json_value
from asyncgraph.jobs._report import Reporter
from asyncgraph.jobs.demo import DEMO_MODEL, build_demo_job, make_demo_model
from asyncgraph.observe import read_call_log
from asyncgraph.text import register_model, unregister_model

from .jobs_helpers import REPO, cli_env, describe, run_cli

pytestmark = pytest.mark.anyio


@pytest.fixture
def fast_demo_model() -> Iterator[None]:
    previous = unregister_model(DEMO_MODEL)
    register_model(DEMO_MODEL, make_demo_model(0.001))
    yield
    unregister_model(DEMO_MODEL)
    if previous is not None:
        register_model(DEMO_MODEL, previous)


def steps_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


async def test_a_traced_logged_run_writes_values_feedback_traces_and_calls(
    tmp_path: Path, fast_demo_model: None
) -> None:
    job, prompt = build_demo_job(epochs=1)
    out = tmp_path / "run"
    log = tmp_path / "calls.jsonl"
    result = await run_job(job, out, progress=False, trace=True, log_calls=log)
    lines = steps_of(out)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[0]["parameters"] == [
        {"name": "system_prompt", "role": prompt.role, "value": "You are a helpful assistant."}
    ]
    assert lines[0]["total_steps"] == 3
    assert lines[-1]["parameters"][0]["value"] == result.parameters[0]
    first = lines[1]
    (feedback,) = first["feedback"]
    assert feedback["role"] == prompt.role and feedback["name"] == "system_prompt"
    assert len(feedback["feedback"]) == 8  # one entry per example of the batch, graph order
    assert all("Add the instruction" in entry for entry in feedback["feedback"])
    assert first["metrics"] == result.history[0]
    assert first["trace"] == "traces/step-0001.json"
    assert first["call_log"] == str(log.resolve())
    # Every step has a valid trace: its phases on row 0, its nodes and calls below.
    for line in lines[1:]:
        events = check_chrome_trace(json.loads((out / line["trace"]).read_text()))
        phases = [e["name"] for e in events if e["cat"] == "phase"]
        assert phases == ["forward", "backward", "optimizer step", "validation"]
        assert {e["name"] for e in events if e["cat"] == "node"} == {"DemoAnswer", "DemoJudge"}
        assert sum(e["cat"] == "model" for e in events) == line["calls"]
    assert (out / "traces" / "step-0000.json").exists()  # the initial validation
    calls = read_call_log(log)
    initial = [c for c in calls if c["labels"]["step"] == 0]
    assert len(initial) == 2 * len(job.val_set)  # the initial validation: answer and judge
    assert len(calls) == sum(line.get("calls", 0) for line in lines) + len(initial)
    by_phase = {(c["labels"]["step"], c["labels"]["phase"]) for c in calls}
    assert (0, "validation") in by_phase and (1, "backward") in by_phase
    assert all(c["labels"]["run"] == str(out.resolve()) for c in calls)
    backward_calls = [c for c in calls if c["labels"]["phase"] == "backward"]
    assert {c["node"]["function"] for c in backward_calls} == {"DemoAnswer", "DemoJudge"}
    step_one = [c for c in calls if c["labels"]["step"] == 1]
    trace_ids = {c["trace_id"] for c in step_one}
    assert trace_ids == {json.loads((out / first["trace"]).read_text())["otherData"]["trace_id"]}


async def test_without_trace_or_log_only_steps_jsonl_is_written_and_resume_appends(
    tmp_path: Path, fast_demo_model: None
) -> None:
    job, _ = build_demo_job(epochs=1)
    out = tmp_path / "run"
    await run_job(job, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "best.json",
        "checkpoint.json",
        "history.json",
        "metrics.png",
        "steps.jsonl",
    ]
    assert all(line.get("trace") is None for line in steps_of(out))
    # Resuming a finished run adds no line.
    again, _ = build_demo_job(epochs=1)
    await run_job(again, out, progress=False, resume=True)
    assert [line["step"] for line in steps_of(out)] == [0, 1, 2, 3]


def test_json_value_keeps_json_data_and_cuts_what_is_not() -> None:
    assert json_value({"a": [1, 2.5, None, True]}) == {"a": [1, 2.5, None, True]}
    assert json_value(float("nan")) is None
    assert json_value("x" * 30_000).endswith(" …[cut]")
    assert json_value(object()).startswith("<object object")


@pytest.mark.slow
def test_asyncgraph_run_trace_writes_a_timeline_per_step_and_log_calls_a_call_log(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    log = tmp_path / "logs" / "calls.jsonl"
    proc = run_cli(
        "run", str(REPO / "examples" / "prompt_job.py"), "--out", str(out), "--no-progress",
        "--trace", "--log-calls", str(log), env=cli_env(PROMPT_JOB_LATENCY_MS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    traces = sorted(p.name for p in (out / "traces").iterdir())
    assert traces == [f"step-{s:04d}.json" for s in range(13)]  # 12 steps + the initial validation
    for name in traces[1:]:
        events = check_chrome_trace(json.loads((out / "traces" / name).read_text()))
        assert any(e["cat"] == "node" for e in events)
    calls = read_call_log(log)
    assert calls and {c["labels"]["step"] for c in calls} == set(range(13))
    assert all(c["process"] and c["latency_s"] >= 0 for c in calls)


def test_the_progress_line_says_cost_unknown_never_zero_dollars(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reporter = Reporter("job", 2)
    reporter.start(0, [])
    row = {
        "step": 1, "epoch": 0, "train_score": 0.5, "train_loss": 0.5, "val_score": None,
        "tokens": 1200, "cost_usd": 0.0, "unpriced_calls": 12, "step_s": 1.0,
    }  # fmt: skip
    reporter.update(1, row)
    reporter.update(2, {**row, "step": 2, "cost_usd": 0.0123, "unpriced_calls": 12})
    reporter.update(2, {**row, "step": 2, "cost_usd": 0.0123, "unpriced_calls": 0})
    reporter.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("tokens 1,200  cost unknown")
    assert lines[1].endswith("tokens 1,200  $0.0123 + unknown")
    assert lines[2].endswith("tokens 1,200  $0.0123")
    assert "$0.0000" not in "\n".join(lines)
