"""Updates that parse with any model: a local fake that answers like a small model
(prose, no tags; JSON only where a schema forces it)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.models import ModelRequestError, OpenAIChat, SimulatedModel
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.models._testing_local import LocalModelTestServer
from asyncgraph.optim import TGD, ReplySkippedWarning, UpdateParseError
from asyncgraph.optim._tgd import UPDATE_FIELD
from asyncgraph.text import TextLoss, llm_call, update_tokens, use_models
from asyncgraph.text._reply import ANSWER_TOKENS, FEEDBACK_TOKENS, VERDICT_TOKENS
from asyncgraph.text._structured import ask_json

pytestmark = pytest.mark.anyio


def _param(value: str, feedback: str) -> Parameter:
    p = Parameter(value, role="system prompt")
    p.grad = Variable(feedback)
    return p


def _local(server: LocalModelTestServer, **options: Any) -> OpenAIChat:
    return OpenAIChat("smollm2", base_url=server.url, api_key="", **options)


async def test_a_small_model_that_ignores_tags_is_optimized_with_structured_outputs() -> None:
    with LocalModelTestServer() as server:
        async with _local(server) as model:
            p = _param("Answer the question.", "Be more precise.")
            await TGD([p], model=model).step()
        assert p.data == "Answer the question. Be precise."
        (request,) = [r.body for r in server.requests]
        spec = request["response_format"]["json_schema"]
        assert spec["schema"]["required"] == [UPDATE_FIELD] and spec["strict"] is True
        assert "<IMPROVED_VARIABLE>" not in request["messages"][-1]["content"]
        # sized to the value, not left to ramble
        assert request["max_tokens"] == update_tokens("Answer the question.") < 300


async def test_with_tags_the_same_model_skips_its_update_and_the_job_goes_on() -> None:
    with LocalModelTestServer() as server:
        async with _local(server) as model:
            p = _param("Answer the question.", "Be more precise.")
            tgd = TGD([p], model=model, structured=False, max_retries=2)
            with pytest.warns(ReplySkippedWarning, match="keeps its value"):
                await tgd.step()
            assert p.data == "Answer the question."
            assert [(s.attempts, s.structured) for s in tgd.skipped] == [(3, False)]
            assert tgd.skipped[0].reply.startswith("Sure! Here is a better version")
            assert all("response_format" not in r.body for r in server.requests)

            tgd.strict = True
            with pytest.raises(UpdateParseError, match="IMPROVED_VARIABLE"):
                await tgd.step()
            assert p.data == "Answer the question."


async def test_a_server_that_refuses_response_format_is_asked_with_tags_from_then_on() -> None:
    with LocalModelTestServer(json_schema=False) as server:
        async with _local(server) as model:
            p = _param("Answer the question.", "Be more precise.")
            tgd = TGD([p], model=model, max_retries=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ReplySkippedWarning)
                await tgd.step()  # refused, then asked with tags: prose, skipped
            assert model.structured_outputs is False
            statuses = server.statuses()
            assert statuses == [400, 200]
            assert "<IMPROVED_VARIABLE>" in server.requests[1].body["messages"][-1]["content"]
            assert len(tgd.skipped) == 1
            p.grad = Variable("Again.")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ReplySkippedWarning)
                await tgd.step()
            assert "response_format" not in server.requests[-1].body  # not tried again


async def test_structured_true_with_a_model_that_does_not_say_sends_the_schema() -> None:
    seen: list[dict[str, Any]] = []

    def responder(messages: list[dict[str, Any]]) -> str:
        seen.append({"messages": messages})
        return '{"improved_variable": "Answer in one word."}'

    model = SimulatedModel(latency_s=0, responder=responder, tag_replies=False)
    p = _param("Answer.", "Shorter.")
    await TGD([p], model=model, structured=True).step()
    assert p.data == "Answer in one word."


async def test_structured_must_be_true_false_or_auto() -> None:
    with pytest.raises(ValueError, match="structured must be True, False or 'auto'"):
        TGD([Parameter("x")], model="simulated", structured="yes")


async def _readme_script(model: OpenAIChat) -> Parameter:
    """The README's first script with ``model``: an answer, a judge, the backward, one
    TGD step; the prompt it optimized."""
    with use_models(model):
        prompt = Parameter("Answer the question.", role="system prompt")
        answer = await llm_call(prompt, Variable("What is 17 * 23?", role="question"))
        loss = await TextLoss("Is the answer correct? Be terse.")(answer)
        await loss.backward()
        await TGD([prompt]).step()
    return prompt


async def test_the_readme_script_completes_against_a_small_local_model() -> None:
    with LocalModelTestServer() as server:
        async with _local(server) as model:
            prompt = await _readme_script(model)
        assert prompt.data == "Answer the question. Be precise."
        sizes = [r.body.get("max_tokens") for r in server.requests]
        assert None not in sizes  # every request says how long a reply it wants
        assert server.refused_for_context == 0


async def test_each_kind_of_request_asks_for_a_reply_of_its_size() -> None:
    """With a window wide enough not to cut them: an answer asks for ``ANSWER_TOKENS``, a
    judge's verdict ``VERDICT_TOKENS``, each feedback request ``FEEDBACK_TOKENS``, the
    update about twice the value's length (``update_tokens``)."""
    with LocalModelTestServer(n_ctx=32768) as server:
        async with _local(server) as model:
            await _readme_script(model)
        sizes = [r.body["max_tokens"] for r in server.requests]
        firsts = [r.body["messages"][0]["content"] for r in server.requests]
    assert sizes == [
        ANSWER_TOKENS,
        VERDICT_TOKENS,
        FEEDBACK_TOKENS,
        FEEDBACK_TOKENS,
        update_tokens("Answer the question."),
    ]
    assert firsts[0] == "Answer the question." and firsts[1].startswith("Is the answer")
    assert all("feedback engine" in text for text in firsts[2:4])


async def test_a_placeholder_for_a_value_is_not_taken_as_one() -> None:
    replies = iter(['{"improved_variable": "..."}', '{"improved_variable": "Answer in one word."}'])
    seen: list[list[dict[str, Any]]] = []

    def responder(messages: list[dict[str, Any]]) -> str:
        seen.append(messages)
        return next(replies)

    model = SimulatedModel(latency_s=0, responder=responder, tag_replies=False)
    p = _param("Answer.", "Shorter.")
    await TGD([p], model=model, structured=True).step()
    assert p.data == "Answer in one word."  # the copied "..." was retried as empty
    assert '"improved_variable" was empty' in seen[1][-1]["content"]
    assert "..." not in seen[0][-1]["content"]  # no placeholder in the request to copy


async def test_a_400_about_something_else_leaves_the_models_structured_outputs_on() -> None:
    """Under "auto", a 400 to a request with response_format is tried once without it;
    refused again, the 400 was not about response_format: its error is raised and the
    model still gets structured outputs (it was turned off for good before)."""
    bad = Reply(status=400, error="'temperature' must be at most 2")
    with OpenAITestServer() as server:
        server.script(bad, bad)
        async with OpenAIChat("m", base_url=server.url, api_key="k") as model:
            schema = {"type": "object", "properties": {"a": {"type": "string"}}}
            messages = [{"role": "user", "content": "x"}]
            with pytest.raises(ModelRequestError, match="temperature"):
                await ask_json(model, messages, {"temperature": 9}, schema)
            assert model.structured_outputs is True
            sent = [r.body for r in server.requests]
            assert ["response_format" in body for body in sent] == [True, False]
            await ask_json(model, messages, {}, schema)  # the next request: with it
            assert "response_format" in server.requests[-1].body
