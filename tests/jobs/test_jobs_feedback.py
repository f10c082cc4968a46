"""A job warns about a parameter that never got feedback, not about a perfect batch."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import Evaluation, Job, run_job
from asyncgraph.models import SimulatedModel
from asyncgraph.optim import TGD, NoFeedbackWarning
from asyncgraph.text import deterministic_evaluator, llm_call, use_models

pytestmark = pytest.mark.anyio
RULE = "Even numbers are 'even'. Odd numbers are 'odd'."
DATA = [{"n": n, "label": "even" if n % 2 == 0 else "odd"} for n in range(1, 17)]


def respond(messages: list[dict[str, Any]]) -> str:
    text = messages[-1]["content"]
    if "IMPROVED_VARIABLE" in text:
        return f"<IMPROVED_VARIABLE>{RULE}</IMPROVED_VARIABLE>"
    if "<VARIABLE>" in text:
        return "State the rule."
    label = "even" if int(text.split()[-1]) % 2 == 0 else "odd"
    return label if RULE in messages[0]["content"] else "unsure"


def metric(answer: str, label: str) -> tuple[float, str]:
    return (1.0, "") if answer == label else (0.0, f"Expected {label!r}.")


def job(*params: Parameter) -> Job:
    prompt = params[0]

    async def forward(example: dict[str, Any]) -> Evaluation:
        answer = await llm_call(prompt, Variable(f"Number: {example['n']}", role="question"))
        score, loss = await deterministic_evaluator(metric, answer, example["label"])
        return Evaluation(loss=loss, score=score.data)

    return Job(
        name="even-odd",
        parameters=list(params),
        forward=forward,
        optimizer=TGD(list(params)),
        train_set=DATA,
        batch_size=4,
        epochs=1,
    )


async def run(tmp_path: Path, *params: Parameter) -> list[warnings.WarningMessage]:
    model = SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False)
    with use_models(model), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await run_job(job(*params), tmp_path / "run", progress=False)
    return [w for w in caught if issubclass(w.category, NoFeedbackWarning)]


async def test_steps_with_every_example_right_draw_no_warning(tmp_path: Path) -> None:
    prompt = Parameter("Label the number.", role="system prompt")
    assert await run(tmp_path, prompt) == []  # steps 2 to 4 had nothing to learn: fine
    assert prompt.data == RULE


async def test_a_parameter_that_never_got_feedback_is_named_once(tmp_path: Path) -> None:
    prompt = Parameter("Label the number.", role="system prompt")
    unused = Parameter("Be polite.", role="style guide")
    [w] = await run(tmp_path, prompt, unused)
    message = str(w.message)
    assert "received no feedback in any of the 4 step(s)" in message
    assert "'style guide'" in message and "system prompt" not in message
