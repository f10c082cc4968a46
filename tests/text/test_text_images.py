"""Images in text graphs (#13 point 2): TextGrad's multimodal use, offline."""

from __future__ import annotations

import base64
import re
from typing import Any

import anyio
import pytest
from text_helpers import Recorder

from asyncgraph import Parameter, Variable
from asyncgraph.distributed import Limits, Worker, WorkerConfig, build_registry, open_redis_executor
from asyncgraph.models import SimulatedModel
from asyncgraph.models._simulated import content_text
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, image, llm_call, render_feedback
from asyncgraph.text._content import describe_content, is_image

pytestmark = pytest.mark.anyio

METER = b"\x89PNG fake image of a meter reading 1042"
INSTRUCTION = "Read every digit of the meter."


def image_bytes_in(messages: list[dict[str, Any]]) -> list[bytes]:
    found = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"]
                    found.append(base64.b64decode(url.split(",", 1)[1]))
    return found


def vision(messages: list[dict[str, Any]]) -> str:
    """Answers about the meter image; judges; proposes the instruction the judge names."""
    text = "\n".join(content_text(m["content"]) for m in messages)
    if "IMPROVED_VARIABLE" in text:
        current = re.findall(r"<VARIABLE>(.*?)</VARIABLE>", text, re.DOTALL)[-1]
        return f"<IMPROVED_VARIABLE>{current} {INSTRUCTION}</IMPROVED_VARIABLE>"
    if "<VARIABLE>" in text:
        return f'Add the instruction: "{INSTRUCTION}"' if "1042" not in text else "fine"
    if "Expected: 1042" in text:  # the judge
        return "correct" if "1042" in text.split("Answer:")[-1] else "wrong: digits missing"
    if METER in image_bytes_in(messages):
        return "1042" if INSTRUCTION in text else "104"
    return "no image"


async def test_an_image_question_is_answered_critiqued_and_its_prompt_optimized() -> None:
    rec = Recorder(vision)
    prompt = Parameter("Answer the question about the image.", role="system prompt")
    photo = Variable(image(METER, mime_type="image/png"), role="photo of the meter")
    question = Variable("What does the meter read?", role="question")
    answer = await llm_call(prompt, question, photo, model=rec.model, role="answer")
    assert answer.data == "104"
    sent = rec.requests[0][-1]["content"]
    assert sent[0] == {
        "type": "text",
        "text": f"What does the meter read?\n\n[image: image/png, {len(METER):,} bytes]",
    }
    assert sent[1]["image_url"]["url"].startswith("data:image/png;base64,")
    judge = TextLoss("Judge. Expected: 1042. Answer: {answer}", model=rec.model)
    loss = await judge(answer)
    assert loss.data.startswith("wrong")
    await loss.backward()
    feedback = render_feedback(prompt.grad)
    assert feedback == f'Add the instruction: "{INSTRUCTION}"'  # feedback about it is text
    # The feedback request carried the image, so the critic saw what the solver saw.
    assert any(
        METER in image_bytes_in(m) and "<VARIABLE>" in content_text(m[-1]["content"])
        for m in rec.requests
    )
    await TGD([prompt], model=rec.model).step()
    assert prompt.data.endswith(INSTRUCTION)
    again = await llm_call(prompt, question, photo, model=rec.model)
    assert again.data == "1042"


def test_image_values_and_their_errors() -> None:
    value = image(METER, mime_type="image/png")
    assert is_image(value) and Variable(value).data == value  # a Variable can hold it
    assert describe_content(value) == f"[image: image/png, {len(METER):,} bytes]"
    assert describe_content(image(url="https://example.com/a.png")) == (
        "[image: https://example.com/a.png]"
    )
    with pytest.raises(TypeError, match="either the image's bytes or url"):
        image()
    with pytest.raises(ValueError, match="image/\\* type"):
        image(b"x", mime_type="text/plain")
    with pytest.raises(ValueError, match="http\\(s\\) or data: URL"):
        image(url="ftp://x")
    assert "[image]" in content_text(
        [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]
    )


async def test_the_simulated_model_answers_image_requests_offline() -> None:
    model = SimulatedModel(latency_s=0)
    out = await llm_call("Describe.", Variable(image(METER)), model=model)
    assert "[image" in out.data and "base64" not in out.data


async def test_images_cross_to_workers_as_bytes_and_a_too_big_one_names_the_limit(
    redis_url: str,
) -> None:
    spec = "simulated:0"

    async def graph(data: bytes) -> tuple[Parameter, Variable]:
        prompt = Parameter("Describe the image.", role="system prompt")
        answer = await llm_call(prompt, Variable(image(data)), model=spec, role="answer")
        return prompt, await TextLoss("Judge the description.", model=spec)(answer)

    local_prompt, local_loss = await graph(METER)
    await local_loss.backward()
    registry = build_registry(["asyncgraph.text"])
    limits = Limits(max_message_bytes=64 * 1024)
    worker = Worker(WorkerConfig(redis_url, queue="img-tests", lease_ms=1000), registry)
    prompt, loss = await graph(METER)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)
            async with open_redis_executor(
                redis_url, queue="img-tests", timeout_s=20, limits=limits
            ) as ex:
                await loss.backward(executor=ex)
                assert prompt.grad is not None and local_prompt.grad is not None
                assert prompt.grad.data == local_prompt.grad.data
                _, big_loss = await graph(b"\x00" * (200 * 1024))
                with pytest.raises(Exception, match="max_message_bytes"):
                    await big_loss.backward(executor=ex)
            worker.drain()
