"""Requests that fit the model (#34): feedback budgets, condensing and the optimizer's
update sized to the context window a local server reports, against a real local fake
that refuses what does not fit with the server's own error."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncgraph import Parameter, Variable, backward
from asyncgraph.models import ModelContextError, OpenAIChat
from asyncgraph.models._testing_local import LocalModelTestServer, local_tokens
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, fit_for, llm_call, python_call
from asyncgraph.text._reply import FEEDBACK_TOKENS

pytestmark = pytest.mark.anyio


def _local(server: LocalModelTestServer, **options: Any) -> OpenAIChat:
    return OpenAIChat("smollm2", base_url=server.url, api_key="", **options)


def _fits(server: LocalModelTestServer) -> None:
    """Every request the server got fit its window with its reply."""
    assert server.refused_for_context == 0
    for r in server.requests:
        assert local_tokens(r.body) + r.body.get("max_tokens", 0) <= server.n_ctx


async def test_a_step_of_many_judges_fits_a_small_window_end_to_end() -> None:
    # vLLM's rule (prompt plus max_tokens within the window) on 2,048 tokens a request.
    with LocalModelTestServer(flavor="vllm", n_ctx=2048, slots=4) as server:
        async with _local(server) as model:
            prompt = Parameter("Answer the question. " * 10, role="system prompt")
            judge = TextLoss("Is the answer right? Explain in detail.", model=model)
            losses: list[Variable] = []

            async def one(i: int) -> None:
                question = Variable(f"What is {i} * 17? Show the steps.", role="question")
                answer = await llm_call(prompt, question, model=model)
                losses.append(await judge(answer))

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
            await backward(losses)
            tgd = TGD([prompt], model=model)  # max_feedback_tokens=4000: more than fits
            await tgd.step()
        _fits(server)
        assert tgd.skipped == [] and prompt.data.endswith("Be precise.")
        summaries = [r for r in server.requests if "condense" in r.body["messages"][0]["content"]]
        assert summaries  # 12 feedbacks of hundreds of tokens were condensed to fit


async def test_a_feedback_budget_is_lowered_to_what_the_window_leaves() -> None:
    with LocalModelTestServer(flavor="vllm", n_ctx=1600) as server:
        async with _local(server) as model:
            system = Parameter("Be helpful. " * 60, role="system prompt")  # ~240 tokens
            answer = await llm_call(system, "Say hi.", model=model)
            answer.grad = None
            await answer.backward(Variable("It should be shorter. " * 200))  # ~1,100 tokens
        _fits(server)


async def test_an_update_that_cannot_fit_says_which_part_is_too_long() -> None:
    with LocalModelTestServer(n_ctx=512) as server:
        async with _local(server) as model:
            p = Parameter("A very long instruction. " * 200, role="system prompt")
            p.grad = Variable("Shorter.")
            with pytest.raises(ModelContextError) as info:
                await TGD([p], model=model, constraints=["Be kind."]).step()
        assert server.requests == []  # nothing sent
    message = str(info.value)
    assert "the update request of the parameter with role 'system prompt'" in message
    assert "The longest is the value" in message and "context_tokens=" in message
    assert info.value.context_tokens == 512


async def test_a_feedback_request_that_cannot_fit_names_its_parts() -> None:
    with LocalModelTestServer(n_ctx=600) as server:
        async with _local(server, context_tokens=100_000) as model:
            # The forward fits (the given window is large), then the window shrinks.
            prompt = Parameter("Follow these rules. " * 60, role="system prompt")
            answer = await llm_call(prompt, "Hi.", model=model)
            model.context_tokens = 600
            with pytest.raises(Exception) as info:
                await answer.backward(Variable("Shorter."))
    error = info.value.__cause__ or info.value
    assert isinstance(error, ModelContextError)
    assert "feedback request of LLMCall" in str(error) and "the system prompt" in str(error)


async def test_a_python_calls_feedback_is_sized_to_the_window_too() -> None:
    with LocalModelTestServer(flavor="vllm", n_ctx=1200) as server:
        async with _local(server) as model:
            text = Parameter("one two three", role="draft")
            count = await python_call(
                lambda t: str(len(t.split())),
                text,
                purpose="Counts the words.",
                role="word count",
                feedback_model=model,
            )
            await count.backward(Variable("The count should be higher. " * 300))  # ~2,400
        _fits(server)
        assert any("condense" in r.body["messages"][0]["content"] for r in server.requests)
        assert text.grad is not None


async def test_a_judges_feedback_quotes_the_answer_once_when_twice_would_not_fit() -> None:
    """A judge's feedback request shows the answer in the judge's prompt and again as the
    variable: where twice does not fit the window, the variable points to the prompt's
    copy instead of the step failing (the demo on a 2,048-token llama.cpp slot)."""
    long_answer = "The answer is 42 because each step adds seven more. " * 24  # ~1,250 chars
    with LocalModelTestServer(n_ctx=1300) as server:
        async with _local(server) as model:
            answer = Variable(long_answer, role="answer", requires_grad=True)
            loss = await TextLoss("Is the answer right? Say why.", model=model)(answer)
            await loss.backward()
            # The room kept for the reply is the max_tokens the request is sent with.
            fit = await fit_for(model)
            assert fit is not None and fit.reply(FEEDBACK_TOKENS) == 1300 // 8
        _fits(server)
        assert server.requests[-1].body["max_tokens"] == 1300 // 8
        feedback = server.requests[-1].body["messages"][-1]["content"]
        assert feedback.count(long_answer) == 1, feedback
        assert "(the text given as the answer in LM_INPUT above)" in feedback
    assert answer.grad is not None and answer.grad.data


async def test_a_feedback_request_that_fits_quotes_the_variable_as_it_is() -> None:
    with LocalModelTestServer(n_ctx=8192) as server:
        async with _local(server) as model:
            answer = Variable("Paris.", role="answer", requires_grad=True)
            loss = await TextLoss("Is the answer right?", model=model)(answer)
            await loss.backward()
        feedback = server.requests[-1].body["messages"][-1]["content"]
        assert "<VARIABLE>Paris.</VARIABLE>" in feedback
        assert "LM_INPUT above" not in feedback


async def test_a_feedback_reply_is_given_less_room_before_the_request_is_given_up() -> None:
    """Quoted once, the answer still leaves too little room beside the reply's share of
    the window (256 of 2,048 tokens): the feedback is asked for in what is left (at least
    128 tokens) rather than the step failing; with more, the error lists every part,
    the feedback instructions included."""
    answer_text = "The answer is 42 because each step adds seven more. " * 78
    with LocalModelTestServer(n_ctx=2048) as server:
        async with _local(server) as model:
            answer = Variable(answer_text, role="answer", requires_grad=True)
            await (await TextLoss("Is the answer right? Say why.", model=model)(answer)).backward()
            assert answer.grad is not None
            longer = answer_text + "Each step adds seven more. " * 30
            too_long = Variable(longer, role="answer", requires_grad=True)
            loss = await TextLoss("Is the answer right? Say why.", model=model)(too_long)
            with pytest.raises(Exception) as info:
                await loss.backward()
        _fits(server)
        feedback_request = server.requests[1].body
        assert feedback_request["messages"][-1]["content"].count(answer_text) == 1
        assert 128 <= feedback_request["max_tokens"] < 2048 // 8
    error = info.value.__cause__ or info.value
    assert isinstance(error, ModelContextError)
    assert "with a reply of 128" in str(error) and "the prompt (inputs) about" in str(error)
    assert "and the instructions and framing about" in str(error)
    assert "the variable" not in str(error)  # shown by reference, not a part of its own
