"""Job(max_cost_usd=...): stop at a step boundary, cut a step that passes the cap anyway,
resume with a higher cap, and refuse unpriced models."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph.jobs import run_job
from asyncgraph.jobs.demo import INITIAL_PROMPT, build_demo_job, demo_responder
from asyncgraph.models import ModelConfigError, Pricing, SimulatedModel
from asyncgraph.text import register_model, unregister_model

from .jobs_helpers import JOB_FILES, describe, run_cli

pytestmark = pytest.mark.anyio


@pytest.fixture
def priced() -> Iterator[str]:
    model = SimulatedModel(
        latency_s=0.002, responder=demo_responder, tag_replies=False, pricing=Pricing(15.0, 60.0)
    )
    register_model("priced-demo", model)
    yield "priced-demo"
    unregister_model("priced-demo")


async def uncapped_costs(tmp_path: Path, model: str) -> list[float]:
    job, _ = build_demo_job(model, epochs=1)
    result = await run_job(job, tmp_path / "uncapped", progress=False)
    return [row["cost_usd"] for row in result.history]


async def test_the_job_stops_at_the_step_boundary_before_passing_the_cap(
    tmp_path: Path, priced: str
) -> None:
    costs = await uncapped_costs(tmp_path, priced)
    cap = (costs[1] + costs[2]) / 2  # step 3 would pass it
    job, _ = build_demo_job(priced, epochs=1)
    job.max_cost_usd = cap
    out = tmp_path / "capped"
    result = await run_job(job, out, progress=False)
    assert result.stopped_at_cost_cap and not result.interrupted
    assert result.steps_done == 2 and result.cost_usd <= cap
    assert result.cost_usd == pytest.approx(costs[1])
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 2
    # A resume with a higher cap goes on to the end, as an uncapped run did.
    job, prompt = build_demo_job(priced, epochs=1)
    job.max_cost_usd = costs[-1] * 2
    resumed = await run_job(job, out, resume=True, progress=False)
    assert not resumed.stopped_at_cost_cap and resumed.steps_done == len(costs)
    assert resumed.cost_usd == pytest.approx(costs[-1])
    assert prompt.data != INITIAL_PROMPT


async def test_a_step_that_passes_the_cap_is_cut_and_rolled_back(
    tmp_path: Path, priced: str
) -> None:
    await uncapped_costs(tmp_path, priced)
    checkpoint = json.loads((tmp_path / "uncapped" / "checkpoint.json").read_text())
    job, prompt = build_demo_job(priced, epochs=1)
    # The initial validation fits; step 1, with no step before it to estimate from, starts
    # and passes the cap.
    job.max_cost_usd = checkpoint["initial_usage"]["cost_usd"] * 1.05
    out = tmp_path / "cut"
    result = await run_job(job, out, progress=False)
    assert result.stopped_at_cost_cap and result.steps_done == 0 and result.history == []
    assert prompt.data == INITIAL_PROMPT  # the half-done step was rolled back
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["step"] == 0 and checkpoint["history"] == []


async def test_a_cap_with_an_unpriced_model_is_an_error_before_any_step(tmp_path: Path) -> None:
    model = SimulatedModel(latency_s=0.001, responder=demo_responder, tag_replies=False)
    model.pricing = None  # a model without a price
    register_model("unpriced-demo", model)
    try:
        job, _ = build_demo_job("unpriced-demo", epochs=1)
        job.max_cost_usd = 1.0
        with pytest.raises(ModelConfigError, match=r"cost cap .* needs every call priced"):
            await run_job(job, tmp_path / "run", progress=False)
    finally:
        unregister_model("unpriced-demo")
    assert json.loads((tmp_path / "run" / "checkpoint.json").read_text())["step"] == 0


def test_the_cap_is_checked() -> None:
    job, _ = build_demo_job(epochs=1)
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="max_cost_usd must be a positive number"):
            type(job)(
                **{
                    **{
                        f: getattr(job, f)
                        for f in ("name", "parameters", "optimizer", "forward", "train_set")
                    },
                    "max_cost_usd": bad,
                }
            )  # type: ignore[arg-type]


@pytest.mark.slow
def test_run_and_demo_take_max_cost_and_say_why_they_stopped(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job_file = JOB_FILES / "priced_job.py"
    first = run_cli(
        "run", str(job_file), "--out", str(out), "--no-progress", "--max-cost", "0.00001"
    )
    assert first.returncode == 0, describe(first)
    assert "stopped at the cost cap" in first.stdout
    assert "spent $" in first.stdout and "of the $1e-05 cap" in first.stdout
    assert "continue with the same command plus --resume and a higher --max-cost" in first.stdout
    again = run_cli(
        "run", str(job_file), "--out", str(out), "--no-progress", "--resume", "--max-cost", "100"
    )
    assert again.returncode == 0, describe(again)
    assert "finished after" in again.stdout
    bad = run_cli("demo", "--max-cost", "0")
    assert bad.returncode == 2 and "must be a number > 0" in bad.stderr


def test_the_report_says_what_was_spent_against_the_cap_and_what_a_crash_did_not_bill(
    tmp_path: Path,
) -> None:
    from asyncgraph.jobs import JobResult
    from asyncgraph.jobs._cli_common import spending_line

    row = {"step": 1, "cost_usd": 0.25, "replayed_calls": 2}
    result = JobResult([row], [], None, None, 1, False, tmp_path, cost_usd=0.25, max_cost_usd=1.0)
    line = spending_line(result)
    assert line is not None and "spent $0.2500 of the $1 cap" in line
    assert "2 model call(s) replayed from their task's journal" in line
    assert spending_line(JobResult([], [], None, None, 0, False, tmp_path)) is None
