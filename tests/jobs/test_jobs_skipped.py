"""A reply that cannot be parsed does not end a job (#34): a small local model that ignores
the tags (a real local HTTP fake of llama.cpp's server) leaves its updates skipped, a
judge whose verdict never fits its response_format scores its example 0; both are in
the history, the progress line, steps.jsonl and the JobResult; strict=True ends the job."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import Evaluation, Job, run_job
from asyncgraph.models import OpenAIChat, SimulatedModel
from asyncgraph.models._testing_local import LocalModelTestServer
from asyncgraph.optim import TGD, NoFeedbackWarning, UpdateParseError
from asyncgraph.text import StructuredOutputError, TextLoss, llm_call

pytestmark = pytest.mark.anyio

TRAIN = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


def _job(model: Any, judge: Any, *, structured: bool | str, strict: bool = False) -> Job:
    prompt = Parameter("Answer the question.", role="system prompt")

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        question = Variable(example["question"], role="question")
        answer = await llm_call(prompt, question, model=model)
        loss = await judge(answer)
        return Evaluation(loss=loss, score=float(answer.data.strip() == example["answer"]))

    tgd = TGD([prompt], model=model, structured=structured, max_retries=1)
    return Job(
        name="small-model",
        parameters=[prompt],
        optimizer=tgd,
        forward=forward,
        train_set=TRAIN,
        val_set=TRAIN[:2],
        batch_size=2,
        strict=strict,
    )


async def test_skipped_updates_are_recorded_and_the_job_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with LocalModelTestServer() as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:
            judge = TextLoss("Is the answer right? Be terse.", model=model)
            job = _job(model, judge, structured=False)
            result = await run_job(job, tmp_path, progress=True)
    assert result.steps_done == 2 and result.parameters == ["Answer the question."]
    assert result.skipped_updates == 2 and result.skipped_examples == 0
    for row in result.history:
        (skipped,) = row["skipped_updates"]
        assert skipped["role"] == "system prompt" and skipped["attempts"] == 2
        assert skipped["reply"].startswith("Sure! Here is a better version")
    out = capsys.readouterr().out
    assert out.count("1 update skipped (unreadable reply)") == 2
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [len(x["metrics"]["skipped_updates"]) for x in lines if "metrics" in x] == [1, 1]


async def test_with_structured_outputs_the_same_job_updates_its_prompt(tmp_path: Path) -> None:
    with LocalModelTestServer() as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:
            judge = TextLoss("Is the answer right? Be terse.", model=model)
            result = await run_job(_job(model, judge, structured="auto"), tmp_path, progress=False)
        assert server.refused_for_context == 0
    assert result.skipped_updates == 0
    assert result.parameters == ["Answer the question. Be precise."]


async def test_strict_job_ends_at_the_first_skipped_update(tmp_path: Path) -> None:
    with LocalModelTestServer() as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:
            judge = TextLoss("Is the answer right? Be terse.", model=model)
            job = _job(model, judge, structured=False, strict=True)
            with pytest.raises(UpdateParseError):
                await run_job(job, tmp_path, progress=False)
            assert job.optimizer.strict is False  # the job's switch was for its run only


@dataclass
class Verdict:
    score: int
    label: Literal["pass", "fail"]


def _judge_replying(text: str) -> Any:
    def reply(messages: list[dict[str, Any]]) -> str:
        if "Grade" in str(messages[0].get("content", "")):
            return text  # the verdict: never the schema
        return "4"

    model = SimulatedModel(latency_s=0, responder=reply, tag_replies=False)

    async def judge(answer: Variable) -> Variable:
        return await llm_call("Grade the answer.", answer, model=model, response_format=Verdict)

    return model, judge


async def test_an_unreadable_verdict_scores_its_example_zero_and_the_job_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, judge = _judge_replying("I think it is fine")
    with pytest.warns(NoFeedbackWarning, match="no feedback in any of the 2 step"):
        result = await run_job(_job(model, judge, structured=False), tmp_path, progress=True)
    assert result.steps_done == 2
    # 2 steps of 2 training examples, 2 validations of 2 and the initial one.
    assert result.skipped_examples == 4 + 4 + 2
    row = result.history[0]
    assert [u["phase"] for u in row["skipped_examples"]] == ["training"] * 2 + ["validation"] * 2
    assert row["train_score"] == 0.0 and row["train_loss"] == 1.0
    assert capsys.readouterr().out.count("4 examples skipped (unreadable verdict)") == 2
    with pytest.raises(BaseException) as info:  # each failing forward: a group of them
        await run_job(
            _job(model, judge, structured=False, strict=True), tmp_path / "strict", progress=False
        )
    error = info.value
    found = error.exceptions if isinstance(error, BaseExceptionGroup) else (error,)
    assert found and all(isinstance(e, StructuredOutputError) for e in found)


async def test_a_small_models_unreadable_verdict_over_http_is_a_skipped_example(
    tmp_path: Path,
) -> None:
    """The judge is a small model behind a server that refuses ``response_format`` (the
    llama.cpp fake, ``json_schema=False``): asked with the format in the prompt, it
    answers in prose; each such example scores 0 and the job completes."""
    with LocalModelTestServer(json_schema=False) as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:

            async def judge(answer: Variable) -> Variable:
                return await llm_call(
                    "Grade the answer.", answer, model=model, response_format=Verdict
                )

            with pytest.warns(NoFeedbackWarning):
                result = await run_job(_job(model, judge, structured=False), tmp_path)
    assert result.steps_done == 2 and result.skipped_examples == 4 + 4 + 2
    row = result.history[0]["skipped_examples"][0]
    assert row["reply"].startswith("Sure! I would be happy to help")
    # Refused for the first judges sent together (a batch of 2), then asked in the prompt.
    assert 1 <= server.statuses().count(400) <= 2


@pytest.mark.slow
async def test_the_dashboard_shows_a_steps_skipped_updates(tmp_path: Path) -> None:
    """The run's page (Chromium) has a card per step saying which update was skipped,
    after how many replies, that the parameter kept its value, and the last reply."""
    from .test_jobs_ui import CHROMIUM_FLAGS, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium to load the dashboard in (see test_jobs_ui.chromium)")
    with LocalModelTestServer() as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:
            judge = TextLoss("Is the answer right? Be terse.", model=model)
            result = await run_job(_job(model, judge, structured=False), tmp_path, progress=False)
    assert result.skipped_updates == 2
    profile = tmp_path / "chromium-profile"
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    card = await _skipped_card(command, tmp_path, step=2)
    assert "skipped in step 2" in card
    assert (
        "update of system prompt skipped: no readable value in 2 replies; it kept its value. "
        "Last reply: Sure! Here is a better version"
    ) in card
    # A judge whose verdict never fits its response_format: the examples it scored 0.
    model, judge = _judge_replying("I think it is fine")
    examples_run = tmp_path / "examples"
    with pytest.warns(NoFeedbackWarning):
        await run_job(_job(model, judge, structured=False), examples_run, progress=False)
    shown = await _skipped_card(command, examples_run, step=1)
    assert shown.count("scored 0: its reply never fit its response_format") == 4, shown
    assert "training example 0 scored 0" in shown and "validation example" in shown
    assert "Last reply: I think it is fine" in shown


async def _skipped_card(command: list[str], run: Path, *, step: int) -> str:
    """The text of the run's skipped card for ``step``, as Chromium renders the dashboard."""
    from .test_jobs_ui import browse, open_ui_server

    with open_ui_server([run]) as url:
        done = await anyio.to_thread.run_sync(
            lambda: browse(command, "--window-size=1200,1600", "--dump-dom", f"{url}&step={step}")
        )
    assert done.returncode == 0, done.stderr[-2000:]
    card = re.search(r'<div class="card skipped">(.*?)</div>', done.stdout, re.S)
    assert card, done.stdout[-3000:]
    return html.unescape(card[1])
