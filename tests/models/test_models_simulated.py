"""SimulatedModel: deterministic, labelled, with latency and scriptable replies."""

from __future__ import annotations

import re
from typing import Any

import anyio
import pytest

from asyncgraph.models import MemoryCache, ModelServerError, Retry, SimulatedModel
from asyncgraph.models._simulated import SIMULATED_TAG, simulated_reply

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def test_same_messages_give_the_same_reply_across_instances() -> None:
    a = await SimulatedModel(latency_s=0).complete(QUESTION)
    b = await SimulatedModel(latency_s=0).complete(QUESTION)
    c = await SimulatedModel(latency_s=0).complete([{"role": "user", "content": "Other?"}])
    assert a == b
    assert a.text != c.text


async def test_every_reply_is_labelled_simulated() -> None:
    answer = await SimulatedModel(latency_s=0).complete(QUESTION)
    assert answer.model == "simulated"
    assert answer.text.startswith(f"{SIMULATED_TAG} ")
    assert "capital of France" in answer.text
    assert answer.prompt_tokens == 6 and answer.completion_tokens == len(answer.text.split())


async def test_latency_is_applied_and_concurrent_calls_overlap() -> None:
    arrived = 0
    all_in = anyio.Event()

    async def responder(messages: object) -> str:
        # Each call answers only once all ten are past their latency: calls run one
        # after another would wait here until the deadline.
        nonlocal arrived
        arrived += 1
        if arrived == 10:
            all_in.set()
        await all_in.wait()
        return "ok"

    model = SimulatedModel(latency_s=2.0, responder=responder)
    started = anyio.current_time()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(model.complete, [{"role": "user", "content": str(i)}])
    assert anyio.current_time() - started >= 2.0  # the latency was applied


async def test_feedback_request_gets_feedback() -> None:
    messages = [
        {"role": "system", "content": "You critique prompts."},
        {"role": "user", "content": "Give feedback on <VARIABLE>Answer the question.</VARIABLE>"},
    ]
    answer = await SimulatedModel(latency_s=0).complete(messages)
    assert answer.text.startswith("[simulated] Feedback on 'Answer the question.'")


async def test_improvement_request_returns_improved_variable_tags() -> None:
    def step(variable: str) -> list[dict[str, Any]]:
        return [
            {
                "role": "user",
                "content": f"Improve <VARIABLE>{variable}</VARIABLE> using the feedback. "
                "Reply with the new text between <IMPROVED_VARIABLE> and "
                "</IMPROVED_VARIABLE>.",
            }
        ]

    model = SimulatedModel(latency_s=0)
    variable = "Answer the question."
    seen = []
    for _ in range(8):
        text = (await model.complete(step(variable))).text
        match = re.search(r"<IMPROVED_VARIABLE>(.*)</IMPROVED_VARIABLE>", text, re.DOTALL)
        assert match is not None, text
        variable = match.group(1)
        seen.append(variable)
    assert seen[0].startswith("Answer the question.\n[simulated edit] ")
    assert seen[1].count("[simulated edit]") == 2
    assert seen[-1] == seen[-2]  # every edit applied once, then it stops changing
    assert seen[-1].count("[simulated edit]") == 6


async def test_responder_scripts_the_replies() -> None:
    calls: list[list[dict[str, Any]]] = []

    def responder(messages: list[dict[str, Any]]) -> str:
        calls.append(messages)
        return "42"

    model = SimulatedModel(latency_s=0, responder=responder)
    assert (await model.complete(QUESTION)).text == "[simulated] 42"
    untagged = SimulatedModel(latency_s=0, responder=responder, tag_replies=False)
    answer = await untagged.complete(QUESTION)
    assert (answer.text, answer.model) == ("42", "simulated")
    assert calls == [QUESTION, QUESTION]


async def test_async_responder_can_wait_on_an_event() -> None:
    release = anyio.Event()

    async def responder(messages: list[dict[str, Any]]) -> str:
        await release.wait()
        return "done"

    model = SimulatedModel(latency_s=0, responder=responder)
    results: list[str] = []

    async def call() -> None:
        results.append((await model.complete(QUESTION)).text)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert results == []
        release.set()
    assert results == ["[simulated] done"]


async def test_responder_errors_go_through_the_retry_middleware() -> None:
    failures = iter([True, True, False])

    def flaky(messages: list[dict[str, Any]]) -> str:
        if next(failures):
            raise ModelServerError("simulated outage", model="simulated", status_code=503)
        return "recovered"

    model = SimulatedModel(latency_s=0, responder=flaky, retry=Retry(backoff_base_s=0.001))
    assert (await model.complete(QUESTION)).text == "[simulated] recovered"
    assert model.usage.snapshot().retries == 2


async def test_responder_must_return_text() -> None:
    model = SimulatedModel(latency_s=0, responder=lambda m: 42)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="must return str"):
        await model.complete(QUESTION)


async def test_simulated_answers_can_be_cached() -> None:
    model = SimulatedModel(latency_s=0, cache=MemoryCache())
    first = await model.complete(QUESTION)
    second = await model.complete(QUESTION)
    assert second.cached and second.text == first.text


def test_simulated_reply_is_a_pure_function() -> None:
    assert simulated_reply(QUESTION) == simulated_reply([dict(QUESTION[0])])
    assert not simulated_reply(QUESTION).startswith(SIMULATED_TAG)


def test_negative_latency_is_rejected() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        SimulatedModel(latency_s=-1)
