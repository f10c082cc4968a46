"""TextLoss (the LLM judge) against the simulated model and a real OpenAI-protocol server."""

from __future__ import annotations

from typing import Any

import pytest
from text_helpers import Recorder

from asyncgraph import Parameter, Variable
from asyncgraph.models import MemoryCache, OpenAIChat, SimulatedModel
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.text import TextLoss, llm_call, register_model, render_feedback, unregister_model

pytestmark = pytest.mark.anyio


async def test_judge_evaluates_and_sends_feedback_to_the_answer(recorder: Recorder) -> None:
    answer = Parameter("5", role="answer to the question")
    loss_fn = TextLoss("Evaluate the answer for correctness.", model=recorder.model)
    loss = await loss_fn(answer)
    assert recorder.requests[0] == [
        {"role": "system", "content": "Evaluate the answer for correctness."},
        {"role": "user", "content": "5"},
    ]
    assert loss.data == "out(5)"
    assert loss.role == "evaluation of the answer to the question"
    await loss.backward()
    assert answer.grad is not None
    assert answer.grad.data == (
        "fix the answer to the question for the evaluation of the answer to the question"
    )


async def test_judge_with_template_fields(recorder: Recorder) -> None:
    question = Variable("2 + 2?", role="question")
    answer = Parameter("5", role="answer")
    loss_fn = TextLoss(
        "Compare the answer to the reference.",
        model=recorder.model,
        template="Question: {question}\nAnswer: {answer}\nReference: {reference}",
    )
    loss = await loss_fn(question=question, answer=answer, reference="4")
    assert recorder.requests[0][1]["content"] == "Question: 2 + 2?\nAnswer: 5\nReference: 4"
    assert loss.role == "evaluation of the question and the answer"
    await loss.backward()
    assert answer.grad is not None and question.grad is None
    with pytest.raises(TypeError, match="fields by name"):
        await loss_fn(answer)


async def test_trainable_judge_instruction_gets_feedback_too(recorder: Recorder) -> None:
    instruction = Parameter("Evaluate.", role="evaluation instruction")
    answer = Parameter("5", role="answer")
    loss = await TextLoss(instruction, model=recorder.model)(answer)
    await loss.backward()
    assert instruction.grad is not None and answer.grad is not None


async def test_repeated_evaluations_are_cache_hits() -> None:
    model = SimulatedModel(latency_s=0.0, cache=MemoryCache())
    loss_fn = TextLoss("Evaluate the answer.", model=model)
    answer = Parameter("4", role="answer")
    first = await loss_fn(answer)
    await first.backward()
    second = await loss_fn(answer)
    await second.backward()
    usage = model.usage.snapshot()
    assert usage.requests == 2  # one evaluation, one feedback request
    assert usage.cache_hits == 2
    assert first.data == second.data
    assert answer.grad is not None and len(answer.grad.data) == 2
    assert answer.grad.data[0] == answer.grad.data[1]


def _server_handler(body: Any) -> Reply:
    content = body["messages"][-1]["content"]
    if "<VARIABLE>" in content:
        return Reply(text="Name the number explicitly.")
    if body["messages"][0]["content"].startswith("Evaluate"):
        return Reply(text="Incorrect: the answer does not state 4.")
    return Reply(text="It is four-ish.")


async def test_pipeline_and_judge_against_the_openai_protocol_server() -> None:
    with OpenAITestServer(handler=_server_handler) as server:
        async with OpenAIChat(
            "test-model", base_url=server.url, api_key="test", cache=MemoryCache()
        ) as model:
            name = register_model("tests-text-http-judge", model)
            try:
                prompt = Parameter("Answer the question.", role="system prompt")
                question = Variable("What is 2 + 2?", role="question")
                answer = await llm_call(prompt, question, model=name, role="answer")
                loss = await TextLoss("Evaluate the answer.", model=name)(answer)
                assert answer.data == "It is four-ish."
                assert loss.data == "Incorrect: the answer does not state 4."
                await loss.backward(retain_graph=True)
                assert prompt.grad is not None
                assert render_feedback(prompt.grad) == "Name the number explicitly."
                bodies = [r.body for r in server.requests]
                assert [r.status for r in server.requests] == [200] * 4
                assert all(b["model"] == "test-model" for b in bodies)
                feedback_bodies = [
                    b for b in bodies if "<VARIABLE>" in b["messages"][-1]["content"]
                ]
                assert "<ROLE>the answer</ROLE>" in feedback_bodies[0]["messages"][-1]["content"]
                assert (
                    "<ROLE>the system prompt</ROLE>"
                    in feedback_bodies[1]["messages"][-1]["content"]
                )
                assert (
                    "Incorrect: the answer does not state 4."
                    in feedback_bodies[0]["messages"][-1]["content"]
                )

                # The same backward again is answered from the response cache.
                await loss.backward()
                assert len(server.requests) == 4
                assert model.usage.snapshot().cache_hits == 2
                assert prompt.grad.data == ["Name the number explicitly."] * 2
            finally:
                unregister_model(name)
