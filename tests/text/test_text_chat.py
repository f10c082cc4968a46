"""Multi-turn messages: ChatCall / chat_call, every Variable turn gets its own feedback."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import pytest
from text_helpers import Recorder

from asyncgraph import Parameter, Variable
from asyncgraph.distributed import Worker, WorkerConfig, build_registry, open_redis_executor
from asyncgraph.text import TextLoss, chat_call, render_feedback
from asyncgraph.text._functions import ChatCall

pytestmark = pytest.mark.anyio

ROLE = re.compile(r"<ROLE>(.*?)</ROLE>")


def responder(messages: list[dict[str, Any]]) -> str:
    content = messages[-1]["content"]
    if "<VARIABLE>" in content:
        return f"improve {ROLE.findall(content)[0]}"
    return "reply to: " + " | ".join(f"{m['role']}={m['content']}" for m in messages)


async def conversation(model: Any) -> tuple[Parameter, Parameter, Variable, Variable]:
    system = Parameter("You are terse.", role="system prompt")
    shot = Parameter("4", role="example answer")
    question = Variable("3 + 3?", role="question", requires_grad=True)
    reply = await chat_call(
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": shot},
            {"role": "user", "content": question},
        ],
        model=model,
        role="answer",
    )
    return system, shot, question, reply


async def test_the_model_gets_the_turns_and_each_variable_turn_its_own_feedback() -> None:
    rec = Recorder(responder)
    system, shot, question, reply = await conversation(rec.model)
    assert rec.requests[0] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3 + 3?"},
    ]
    assert reply.data.startswith("reply to: system=You are terse.")
    await reply.backward("too long")
    assert render_feedback(system.grad) == "improve the system prompt"
    assert render_feedback(shot.grad) == "improve the example answer"
    assert render_feedback(question.grad) == "improve the question"
    feedback_requests = rec.feedback_requests()
    assert len(feedback_requests) == 3
    # Each request shows the whole conversation, turn by turn, and the feedback.
    assert all("<ASSISTANT_MESSAGE>\n4\n</ASSISTANT_MESSAGE>" in r for r in feedback_requests)
    assert all("too long" in r for r in feedback_requests)


async def test_plain_string_turns_get_no_gradient_and_bad_messages_are_clear() -> None:
    rec = Recorder(responder)
    system = Parameter("Be kind.", role="system prompt")
    reply = await chat_call(
        [{"role": "system", "content": system}, {"role": "user", "content": "hi"}], model=rec.model
    )
    await reply.backward("warmer")
    assert render_feedback(system.grad) == "improve the system prompt"
    with pytest.raises(TypeError, match="roles must be a list of"):
        await ChatCall.apply(("narrator",), "x", model=rec.model)
    with pytest.raises(TypeError, match="1 role\\(s\\) for 2 message content\\(s\\)"):
        await ChatCall.apply(("user",), "x", "y", model=rec.model)
    with pytest.raises(TypeError, match="message 0 must be a dict with 'role' and 'content'"):
        await chat_call([{"role": "user"}], model=rec.model)


async def test_a_list_where_a_text_goes_is_an_error_not_its_repr() -> None:
    """afnio writes a message's content as a list of Variables: sent as the list's repr,
    the Variables in it would get no gradient, and nothing would say so."""
    from asyncgraph.text import concat, llm_call

    rec = Recorder(responder)
    system = Parameter("You are a dev.", role="agent behaviour")
    with pytest.raises(TypeError, match="message 0's content is a list; give one str or Variable"):
        await chat_call([{"role": "system", "content": [system]}], model=rec.model)
    with pytest.raises(TypeError, match=r"a list where a text was expected.*concat"):
        await llm_call(None, [system], model=rec.model)
    with pytest.raises(TypeError, match="a tuple where a text was expected"):
        concat("a", ("b", "c"))
    assert rec.requests == []  # nothing was sent
    # Joined with concat, each stays in the graph.
    reply = await chat_call(
        [{"role": "system", "content": concat(system, "Answer in one line.")}], model=rec.model
    )
    await reply.backward("shorter")
    assert system.grad is not None


async def test_structured_chat_replies() -> None:
    rec = Recorder(lambda m: json.dumps({"answer": 6}))
    out = await chat_call(
        [{"role": "user", "content": "3 + 3?"}],
        model=rec.model,
        response_format={"type": "object", "properties": {"answer": {"type": "integer"}}},
    )
    assert out.data == {"answer": 6}


async def test_remote_chat_backward_equals_local(redis_url: str) -> None:
    spec = "simulated:0"

    async def graph() -> tuple[Parameter, Parameter, Variable]:
        system, shot, _, reply = await conversation(spec)
        loss = await TextLoss("Evaluate the answer.", model=spec)(reply)
        return system, shot, loss

    local_system, local_shot, local_loss = await graph()
    await local_loss.backward()
    registry = build_registry(["asyncgraph.text"])
    assert "asyncgraph.text.ChatCall" in registry
    worker = Worker(WorkerConfig(redis_url, queue="chat-tests", lease_ms=1000), registry)
    system, shot, loss = await graph()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)
            async with open_redis_executor(redis_url, queue="chat-tests", timeout_s=20) as ex:
                await loss.backward(executor=ex)
                assert ex.stats.submitted == 2  # the judge and the chat call
            worker.drain()
    assert system.grad is not None and local_system.grad is not None
    assert system.grad.data == local_system.grad.data
    assert shot.grad is not None and local_shot.grad is not None
    assert shot.grad.data == local_shot.grad.data
