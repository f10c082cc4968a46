"""Job(max_cost_usd=...): stop at a step boundary, cut a step that passes the cap anyway,
resume with a higher cap, and refuse unpriced models."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import Evaluation, Job, run_job
from asyncgraph.jobs._ui import run_summary
from asyncgraph.jobs.demo import INITIAL_PROMPT, DemoProgram, build_demo_job, demo_responder
from asyncgraph.models import ModelConfigError, OpenAIChat, Pricing, SimulatedModel, observe_calls
from asyncgraph.models._testing import OpenAITestServer
from asyncgraph.optim import TGD
from asyncgraph.text import llm_call, register_model, unregister_model

from .jobs_helpers import JOB_FILES, cli_env, describe, run_cli, run_events, without

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
    # The cut step's calls were paid: what the job spent counts them, here and on resume.
    initial = checkpoint["initial_usage"]["cost_usd"]
    assert result.cost_usd > job.max_cost_usd > initial
    assert checkpoint["spent"]["cost_usd"] == pytest.approx(result.cost_usd)
    job, prompt = build_demo_job(priced, epochs=1)
    job.max_cost_usd = 1000.0
    resumed = await run_job(job, out, resume=True, progress=False)
    assert resumed.steps_done == job.total_steps and prompt.data != INITIAL_PROMPT
    uncapped = await uncapped_costs(tmp_path / "again", priced)
    # Every call of both runs: the uncapped run's, plus the cut step's.
    cut_step = result.cost_usd - initial
    assert resumed.cost_usd == pytest.approx(uncapped[-1] + cut_step)
    assert resumed.history[-1]["cost_usd"] == pytest.approx(resumed.cost_usd)


def prompt_after(out: Path, step: int) -> str:
    """The prompt after ``step``, from ``out/steps.jsonl``."""
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    (row,) = [x for x in lines if x.get("step") == step and "parameters" in x]
    return str(row["parameters"][0]["value"])


async def test_a_cap_passed_in_step_3_rolls_back_to_step_2_and_a_resume_ends_uncapped(
    tmp_path: Path, priced: str
) -> None:
    def demo_job(cap: float | None) -> tuple[Job, Parameter]:
        job, prompt = build_demo_job(priced, epochs=1)
        # One validation, in step 3: steps 1 and 2 (without one) are what step 3 is
        # estimated from, and its validation comes after its optimizer step.
        job.validate_every, job.max_cost_usd = 3, cap
        return job, prompt

    spent: list[float] = [0.0]  # the running cost of the calls so far
    after_optimizer: list[float] = []  # ... at the end of each step's optimizer call
    improved: list[str] = []  # the optimizer's answers: the prompt after each step

    def observe(call: Any) -> None:
        spent[0] += call.cost_usd
        if call.reply and "<IMPROVED_VARIABLE>" in call.reply:
            improved.append(call.reply)
            after_optimizer.append(spent[0])

    job, _ = demo_job(None)
    with observe_calls(observe):
        uncapped = await run_job(job, tmp_path / "uncapped", progress=False)
    initial = json.loads((tmp_path / "uncapped" / "checkpoint.json").read_text())
    totals = [row["cost_usd"] for row in uncapped.history]
    before = [initial["initial_usage"]["cost_usd"], *totals[:-1]]
    costs = [b - a for a, b in zip(before, totals, strict=True)]
    # A quarter into step 3's validation: past the estimate step 3 started on (the
    # dearest step before it), after its optimizer step, well before its last call.
    cap = after_optimizer[2] + (totals[2] - after_optimizer[2]) / 4
    assert len(costs) == 3 and totals[1] + max(costs[:2]) < cap < totals[2]
    after_step_2 = prompt_after(tmp_path / "uncapped", 2)

    job, prompt = demo_job(cap)
    out = tmp_path / "cut"
    improved.clear()
    with observe_calls(observe):
        result = await run_job(job, out, progress=False)
    assert result.stopped_at_cost_cap and not result.interrupted and result.steps_done == 2
    # Cut in step 3, after its optimizer step had changed the prompt: rolled back to the
    # checkpoint of step 2, the uncapped run's parameters after step 2.
    assert improved[2:] == [f"<IMPROVED_VARIABLE>{uncapped.parameters[0]}</IMPROVED_VARIABLE>"]
    assert prompt.data == after_step_2 == result.parameters[0] != uncapped.parameters[0]
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["step"] == 2 and checkpoint["module"]["system_prompt"] == after_step_2
    assert [row["cost_usd"] for row in checkpoint["history"]] == pytest.approx(totals[:2])
    assert run_events(out)[-1] == ("stop", 2, "cost_cap")
    # What was paid: the two whole steps and the cut part of step 3.
    assert totals[1] < cap < result.cost_usd < totals[2]
    assert checkpoint["spent"]["cost_usd"] == pytest.approx(result.cost_usd)
    cut_step = result.cost_usd - totals[1]

    job, prompt = demo_job(totals[2] * 10)
    resumed = await run_job(job, out, resume=True, progress=False)
    assert not resumed.stopped_at_cost_cap and resumed.steps_done == 3
    assert resumed.parameters == uncapped.parameters == [prompt.data]
    assert resumed.final_val_score == uncapped.final_val_score is not None
    spending = frozenset({"step_s", "tokens", "cost_usd"})  # the cut step's calls add to these
    assert without(resumed.history, spending) == without(uncapped.history, spending)
    assert resumed.cost_usd == pytest.approx(totals[2] + cut_step)
    assert resumed.history[-1]["cost_usd"] == pytest.approx(resumed.cost_usd)
    assert json.loads((out / "checkpoint.json").read_text())["spent"]["cost_usd"] == pytest.approx(
        resumed.cost_usd
    )


async def test_a_cap_passed_by_the_jobs_last_call_is_reported_as_what_happened(
    tmp_path: Path, priced: str
) -> None:
    costs = await uncapped_costs(tmp_path, priced)
    job, _ = build_demo_job(priced, epochs=1)
    job.max_cost_usd = costs[-1] - 1e-9  # the very last call passes it
    out = tmp_path / "last"
    result = await run_job(job, out, progress=False)
    summary = run_summary(out)
    step = json.loads((out / "checkpoint.json").read_text())["step"]
    if result.steps_done == job.total_steps:
        # No await after that call took the stop (trio): the job finished, and says so.
        assert not result.stopped_at_cost_cap and summary["stopped"] is None
        assert step == job.total_steps
    else:  # the stop cut the last step: rolled back to the one before, and says so
        assert result.stopped_at_cost_cap and summary["stopped_at_cost_cap"]
        assert result.steps_done == step == job.total_steps - 1
    assert result.cost_usd == pytest.approx(costs[-1])  # every call was paid


@pytest.fixture
def unpriced() -> Iterator[list[Any]]:
    """The demo's model without a price, as "unpriced-demo"; yields the messages of its calls."""
    calls: list[Any] = []

    def answer(messages: Any) -> str:
        calls.append(messages)
        return demo_responder(messages)

    model = SimulatedModel(latency_s=0.001, responder=answer, tag_replies=False)
    model.pricing = None  # a model without a price
    register_model("unpriced-demo", model)
    yield calls
    unregister_model("unpriced-demo")


async def test_a_capped_job_that_can_reach_an_unpriced_model_fails_at_start(
    tmp_path: Path, unpriced: list[Any], priced: str
) -> None:
    # The Module (the job's forward and parameters) names the unpriced model; the
    # optimizer's is priced.
    program = DemoProgram("unpriced-demo")
    job, _ = build_demo_job(priced, epochs=1)
    job = dataclasses.replace(job, parameters=program, forward=program, max_cost_usd=1.0)
    with pytest.raises(ModelConfigError, match=r"cost cap .* needs every call priced") as error:
        await run_job(job, tmp_path / "run", progress=False)
    assert "SimulatedModel 'unpriced-demo' at parameters.model" in str(error.value)
    assert unpriced == [] and not (tmp_path / "run").exists()  # no call, nothing written
    # Without a cap nothing is checked: the same job runs.
    job = dataclasses.replace(job, max_cost_usd=None)
    result = await run_job(job, tmp_path / "uncapped", progress=False)
    assert result.steps_done == 3 and unpriced


async def test_a_model_named_while_the_job_runs_is_caught_at_its_first_call(
    tmp_path: Path, unpriced: list[Any]
) -> None:
    prompt = Parameter("You are a helpful assistant.", role="system prompt")

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        name = "-".join(["unpriced", "demo"])  # not visible before it runs
        question = Variable(example["question"], role="question")
        answer = await llm_call(prompt, question, model=name)
        return Evaluation(loss=answer, score=0.0)

    job = Job(
        name="named-late",
        parameters=[prompt],
        optimizer=TGD([prompt], model="simulated"),
        forward=forward,
        train_set=[{"question": "What is 2 + 2?"}],
        val_set=[{"question": "What is 3 + 3?"}],
        max_cost_usd=1.0,
    )
    with pytest.raises(ModelConfigError, match=r"a model without a price answered a call"):
        await run_job(job, tmp_path / "run", progress=False)
    assert len(unpriced) == 1  # the first call, and no other
    assert json.loads((tmp_path / "run" / "checkpoint.json").read_text())["step"] == 0


async def test_an_unpriced_http_model_is_refused_before_any_request_a_priced_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with OpenAITestServer() as server:
        url = server.url
        prompt = Parameter("Answer.", role="system prompt")
        priced_model = OpenAIChat(
            "house-model", base_url=url, api_key="sk-test", pricing=Pricing(1, 2)
        )

        def job_of(forward: Any, cap: float | None) -> Job:
            return Job(
                name="over-http",
                parameters=[prompt],
                optimizer=TGD([prompt], model="simulated"),
                forward=forward,
                train_set=[{"q": "2 + 2?"}, {"q": "3 + 3?"}],
                batch_size=2,
                max_cost_usd=cap,
            )

        async def unpriced_forward(example: Mapping[str, Any]) -> Evaluation:
            # A spec with no price in the table, at the test server.
            answer = await llm_call(prompt, example["q"], model="openai:house-model", base_url=url)
            return Evaluation(loss=answer, score=0.0)

        async def priced_forward(example: Mapping[str, Any]) -> Evaluation:
            answer = await llm_call(prompt, example["q"], model=priced_model)
            return Evaluation(loss=answer, score=0.0)

        with pytest.raises(ModelConfigError, match=r"forward's model= argument") as error:
            await run_job(job_of(unpriced_forward, 1.0), tmp_path / "refused", progress=False)
        assert "OpenAIChat 'openai:house-model'" in str(error.value)
        assert server.requests == [] and not (tmp_path / "refused").exists()
        result = await run_job(job_of(priced_forward, 1.0), tmp_path / "priced", progress=False)
        assert result.steps_done == 1 and 0 < result.cost_usd < 1.0
        assert len(server.requests) == 4  # two forwards, and the feedback of their backwards
        await run_job(job_of(unpriced_forward, None), tmp_path / "uncapped", progress=False)
        assert len(server.requests) == 8  # no cap: not checked, and it runs


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


@pytest.mark.slow
def test_run_with_a_cap_refuses_an_unpriced_model_in_one_error_line_before_any_call(
    tmp_path: Path,
) -> None:
    calls, out = tmp_path / "calls.txt", tmp_path / "run"
    job_file = str(JOB_FILES / "unpriced_job.py")
    env = cli_env(UNPRICED_JOB_CALLS=str(calls))
    refused = run_cli(
        "run", job_file, "--out", str(out), "--no-progress", "--max-cost", "1", env=env
    )
    assert refused.returncode == 1, describe(refused)
    (line,) = refused.stderr.splitlines()  # one line, no traceback, no resume hint
    assert line.startswith("error: job 'demo-prompt-optimization' can call a model without")
    assert (
        "(max_cost_usd=1)" in line and "SimulatedModel 'unpriced-demo' at optimizer.model" in line
    )
    assert not calls.exists() and not out.exists()
    ran = run_cli("run", job_file, "--out", str(out), "--no-progress", env=env)  # no cap
    assert ran.returncode == 0 and calls.exists(), describe(ran)


def test_the_report_says_what_was_spent_against_the_cap_and_what_a_crash_did_not_bill(
    tmp_path: Path,
) -> None:
    from asyncgraph.jobs import JobResult
    from asyncgraph.jobs._cli_common import spending_line

    row = {"step": 1, "cost_usd": 0.25, "replayed_calls": 2}
    result = JobResult(
        [row], [], None, None, 1, False, tmp_path, cost_usd=0.25, max_cost_usd=1.0, replayed_calls=2
    )
    line = spending_line(result)
    assert line is not None and "spent $0.2500 of the $1 cap" in line
    assert "2 model call(s) replayed from their task's journal" in line
    assert spending_line(JobResult([], [], None, None, 0, False, tmp_path)) is None
    uncapped = JobResult([row], [], None, None, 1, False, tmp_path, cost_usd=0.25)
    assert spending_line(uncapped) == "spent $0.2500 on model calls"
