"""Feedback through a 3-stage pipeline whose stages share one system prompt."""

from __future__ import annotations

import pytest
from text_helpers import Recorder

from asyncgraph import LocalExecutor, Parameter, Variable
from asyncgraph.text import TextLoss, llm_call, render_feedback

pytestmark = pytest.mark.anyio


async def _pipeline(recorder: Recorder) -> tuple[Parameter, Variable, Variable]:
    prompt = Parameter("Be accurate.", role="system prompt")
    question = Variable("What is 2 + 2?", role="question")
    draft = await llm_call(prompt, question, model=recorder.model, role="draft answer")
    refined = await llm_call(prompt, draft, model=recorder.model, role="refined answer")
    final = await llm_call(prompt, refined, model=recorder.model, role="final answer")
    loss = await TextLoss("Evaluate the final answer.", model=recorder.model)(final)
    return prompt, question, loss


async def test_shared_parameter_gets_each_paths_feedback_once_in_graph_order() -> None:
    recorder = Recorder()
    prompt, question, loss = await _pipeline(recorder)
    assert loss.role == "evaluation of the final answer"
    await loss.backward()

    # Hand-derived: each stage asks for feedback on the prompt, naming its own output.
    assert prompt.grad is not None
    assert prompt.grad.data == [
        "fix the system prompt for the draft answer",
        "fix the system prompt for the refined answer",
        "fix the system prompt for the final answer",
    ]
    assert question.grad is None
    assert render_feedback(prompt.grad) == (
        "--- feedback 1 of 3 ---\nfix the system prompt for the draft answer\n\n"
        "--- feedback 2 of 3 ---\nfix the system prompt for the refined answer\n\n"
        "--- feedback 3 of 3 ---\nfix the system prompt for the final answer"
    )

    # Each stage's output feedback is the next stage's feedback on its input.
    requests = recorder.feedback_requests()
    assert (
        len(requests) == 6
    )  # loss->final, final->{prompt, refined}, refined->{prompt, draft}, draft->prompt
    draft_request = next(r for r in requests if "The output of this call is the draft answer." in r)
    assert (
        "<OUTPUT_FEEDBACK>\nfix the draft answer for the refined answer\n</OUTPUT_FEEDBACK>"
        in draft_request
    )
    loss_request = next(r for r in requests if "the evaluation of the final answer." in r)
    assert "No feedback was given on the output" in loss_request


async def test_gradients_do_not_depend_on_concurrency() -> None:
    unbounded, serial = Recorder(), Recorder()
    p1, _, loss1 = await _pipeline(unbounded)
    p2, _, loss2 = await _pipeline(serial)
    await loss1.backward()
    await loss2.backward(executor=LocalExecutor(max_concurrency=1))
    assert p1.grad is not None and p2.grad is not None
    assert p1.grad.data == p2.grad.data
