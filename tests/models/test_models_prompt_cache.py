"""Prompt caching that pays: the fakes apply each provider's documented caching rule, and
the requests asyncgraph builds put what they share first (NOTE [Shared prefix first])."""

from __future__ import annotations

from typing import Any

import pytest

from asyncgraph import Parameter, Variable, backward
from asyncgraph.models import AnthropicChat, Completion, OpenAIChat
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.models._testing_providers import AnthropicTestServer
from asyncgraph.optim._prompts import update_messages
from asyncgraph.text import llm_call
from asyncgraph.text._prompts import llm_feedback_messages, marks_shared_prefix

pytestmark = pytest.mark.anyio


def words(n: int, word: str = "w") -> str:
    return " ".join(f"{word}{i}" for i in range(n))


async def test_the_openai_fake_caches_prefixes_of_1024_tokens_and_more_in_128_token_steps() -> None:
    shared = words(1200)
    with OpenAITestServer(prompt_cache=True) as server:
        async with OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="sk-test") as model:
            first = await model.complete([{"role": "user", "content": f"{shared} a b c"}])
            second = await model.complete([{"role": "user", "content": f"{shared} x y"}])
            short = await model.complete([{"role": "user", "content": words(1000)}])
            again = await model.complete([{"role": "user", "content": words(1000)}])
            other = await model.complete([{"role": "system", "content": f"{shared} x y"}])
    assert first.cache_read_tokens == 0
    # 1,200 shared words: 1,024 + 128 = 1,152 cached, the rest in no full step.
    assert second.prompt_tokens == 1202 and second.cache_read_tokens == 1152
    assert short.cache_read_tokens == again.cache_read_tokens == 0  # under 1,024 tokens
    assert other.cache_read_tokens == 0  # another role: another prefix


async def test_the_openai_fake_reports_no_cached_tokens_unless_asked() -> None:
    with OpenAITestServer() as server:
        async with OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="sk-test") as model:
            for _ in range(2):
                await model.complete([{"role": "user", "content": words(2000)}])
    assert "prompt_tokens_details" not in str(server.requests[-1].body)
    assert model.usage.snapshot().cache_read_tokens == 0


async def test_the_anthropic_fake_reads_the_longest_marked_prefix_and_skips_short_ones() -> None:
    def marked(*texts: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}} for t in texts]

    with AnthropicTestServer(min_cache_tokens=100) as server:
        async with AnthropicChat(
            "claude-sonnet-4", base_url=server.url, api_key="anthropic-test-key"
        ) as model:
            base = [{"role": "system", "content": marked(words(150))}]
            one = await model.complete([*base, {"role": "user", "content": "hi"}])
            longer = [{"role": "system", "content": marked(words(150), words(50, "v"))}]
            two = await model.complete([*longer, {"role": "user", "content": "hi"}])
            tiny = [{"role": "system", "content": marked(words(10))}]
            three = await model.complete([*tiny, {"role": "user", "content": "hi"}])
            four = await model.complete([*tiny, {"role": "user", "content": "hi"}])
    assert (one.cache_write_tokens, one.cache_read_tokens) == (150, 0)
    assert (two.cache_write_tokens, two.cache_read_tokens) == (50, 150)  # reads the first mark
    assert (
        (four.cache_write_tokens, four.cache_read_tokens)
        == (0, 0)
        == (
            three.cache_write_tokens,
            three.cache_read_tokens,
        )
    )


def test_feedback_on_a_system_prompt_puts_it_before_what_differs_between_calls() -> None:
    def ask(question: str, variable: str) -> str:
        messages = llm_feedback_messages(
            system_prompt="RULES",
            user_prompt=question,
            output=f"answer to {question}",
            output_role="the answer",
            variable=variable,
            variable_role="the system prompt" if variable == "RULES" else "the question",
            feedback="wrong",
        )
        assert [m["role"] for m in messages] == ["system", "user"]
        return str(messages[1]["content"])

    first, second = ask("Q1", "RULES"), ask("Q2", "RULES")
    # Everything up to the call's input is the same text, the variable included.
    common = first[: first.index("<LM_INPUT>")]
    assert second.startswith(common) and "<VARIABLE>RULES</VARIABLE>" in common
    assert common.index("<LM_SYSTEM_PROMPT>") < common.index("<VARIABLE>")
    # A variable that differs from call to call comes after the call's input and output.
    on_input = ask("Q1", "Q1")
    assert on_input.index("<LM_OUTPUT>") < on_input.index("<VARIABLE>Q1</VARIABLE>")
    assert on_input.count("<VARIABLE>") == first.count("<VARIABLE>") == 1


def test_the_update_request_puts_what_stays_across_steps_first() -> None:
    messages = update_messages(
        role="the prompt",
        value="VALUE",
        feedback="FEEDBACK",
        history=[{"value": "OLD", "feedback": "OLDFB"}],
        constraints=["be short"],
        open_tag="<IMPROVED_VARIABLE>",
        close_tag="</IMPROVED_VARIABLE>",
        system_prompt=None,
        examples=["EXAMPLE"],
    )
    text = str(messages[1]["content"])
    order = ["<ROLE>", "<CONSTRAINTS>", "<EXAMPLES>", "<VARIABLE>", "<FEEDBACK>", "<PAST_"]
    assert [text.index(tag) for tag in order] == sorted(text.index(tag) for tag in order)


async def test_a_step_of_feedback_requests_is_served_mostly_from_the_openai_cache() -> None:
    rules = words(1500, "rule")

    def reply(body: Any) -> Reply:
        return Reply(text="Add a rule." if "feedback engine" in str(body) else "42")

    with OpenAITestServer(prompt_cache=True, handler=reply) as server:
        async with OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="sk-test") as model:
            prompt = Parameter(rules, role="system prompt")
            answers = [
                await llm_call(prompt, Variable(f"question {i}"), model=model) for i in range(4)
            ]
            grads = [Variable("wrong") for _ in answers]
            # The first pass's requests run at once: the first to arrive finds no prefix.
            await backward(answers, grads, retain_graph=True)
            before = model.usage.snapshot()
            await backward(answers, grads)
            after = model.usage.snapshot()
    assert prompt.grad is not None
    feedback_input = after.prompt_tokens - before.prompt_tokens
    feedback_read = after.cache_read_tokens - before.cache_read_tokens
    # Four feedback requests of about 3,200 tokens; all but the question, answer and
    # feedback (and the last part of a 128-token step) shared.
    assert feedback_read / feedback_input > 0.9


async def test_feedback_requests_to_claude_mark_their_shared_prefix_and_read_it_back() -> None:
    rules = words(1500, "rule")

    def reply(body: Any) -> Reply:
        return Reply(text="Add a rule." if "feedback engine" in str(body) else "42")

    with AnthropicTestServer(min_cache_tokens=1024, handler=reply) as server:
        async with AnthropicChat(
            "claude-sonnet-4", base_url=server.url, api_key="anthropic-test-key", cache_prompt=True
        ) as model:
            prompt = Parameter(rules, role="system prompt")
            answers = [
                await llm_call(prompt, Variable(f"question {i}"), model=model) for i in range(4)
            ]
            grads = [Variable("wrong") for _ in answers]
            await backward(answers, grads, retain_graph=True)
            before = model.usage.snapshot()
            await backward(answers, grads)
            after = model.usage.snapshot()
    feedback = [r.body for r in server.requests if "feedback engine" in str(r.body["system"])]
    assert len(feedback) == 8
    shared, rest = feedback[0]["messages"][-1]["content"]
    assert shared["cache_control"] == {"type": "ephemeral"} and "cache_control" not in rest
    assert shared["text"].endswith(f"<VARIABLE>{rules}</VARIABLE>")
    assert rest["text"].startswith("<LM_INPUT>\nquestion ")
    assert after.cache_read_tokens - before.cache_read_tokens > 0.9 * (
        after.prompt_tokens - before.prompt_tokens
    )


async def test_a_model_that_does_not_mark_gets_each_message_as_one_string() -> None:
    seen: list[list[dict[str, Any]]] = []

    class Plain:
        cache_prompt = "yes"  # not True: no marks

        async def complete(self, messages: Any, **params: Any) -> Completion:
            seen.append(messages)
            return Completion("ok", model="plain")

    prompt = Parameter("rules", role="system prompt")
    answer = await llm_call(prompt, "question", model=Plain())
    await backward(answer, Variable("wrong"))
    assert len(seen) == 2 and all(isinstance(m["content"], str) for m in seen[1])
    assert marks_shared_prefix(AnthropicChat("c", base_url="http://x", cache_prompt=True))
    assert not marks_shared_prefix(AnthropicChat("c", base_url="http://x"))
