"""The text Functions' backwards on a real worker, through a real Redis.

The worker serves ``--import asyncgraph.text`` and resolves the model spec
``"simulated:0"`` itself (the builtin simulated replies are a deterministic
function of the messages), so the remote gradients must equal the local ones.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from text_helpers import NamedModel

from asyncgraph import Parameter, Variable
from asyncgraph.distributed import Worker, WorkerConfig, build_registry, open_redis_executor
from asyncgraph.models import SimulatedModel
from asyncgraph.text import (
    LLMCall,
    LLMOptions,
    TextLoss,
    check_portable,
    concat,
    llm_call,
    register_model,
    unregister_model,
)
from asyncgraph.text._registry import ModelRef

pytestmark = pytest.mark.anyio

SPEC = "simulated:0"


async def _graph() -> tuple[Parameter, Parameter, Variable]:
    prompt = Parameter("Answer the question.", role="system prompt")
    draft = Parameter("It is 4.", role="draft answer")
    losses = []
    for i in range(3):
        answer = await llm_call(prompt, f"What is {i} + {i}?", draft, model=SPEC, role="answer")
        losses.append(await TextLoss("Evaluate the answer critically.", model=SPEC)(answer))
    return prompt, draft, concat(*losses)


async def test_remote_backward_equals_local_backward(redis_url: str) -> None:
    local_prompt, local_draft, local_total = await _graph()
    await local_total.backward()

    registry = build_registry(["asyncgraph.text"])
    assert {"asyncgraph.text.LLMCall", "asyncgraph.text.FormattedLLMCall"} <= set(registry)
    worker = Worker(WorkerConfig(redis_url, queue="text-tests", lease_ms=1000), registry)
    prompt, draft, total = await _graph()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)
            async with open_redis_executor(redis_url, queue="text-tests", timeout_s=20) as executor:
                await total.backward(executor=executor)
                assert executor.stats.submitted == 6  # 3 judges + 3 answers; concat stays local
            worker.drain()

    assert prompt.grad is not None and draft.grad is not None
    assert local_prompt.grad is not None and local_draft.grad is not None
    assert prompt.grad.data == local_prompt.grad.data
    assert draft.grad.data == local_draft.grad.data
    assert len(prompt.grad.data) == 3


async def test_the_options_record_travels_with_the_ctx_both_ways(redis_url: str) -> None:
    """A forward on the worker sends its ``LLMOptions`` back, typed; a backward on the
    worker uses the caller's options: feedback model, feedback params and budget."""
    log: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []
    register_model("tests-options-feedback", NamedModel("feedback", log))  # the worker's too
    worker = Worker(
        WorkerConfig(redis_url, queue="text-tests-options", lease_ms=1000),
        build_registry(["asyncgraph.text"]),
    )
    prompt = Parameter("Answer the question.", role="system prompt")
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(worker.serve)
                async with open_redis_executor(
                    redis_url, queue="text-tests-options", timeout_s=20
                ) as executor:
                    answer = await executor.apply(
                        LLMCall,
                        prompt,
                        "What is 2 + 2?",
                        model=SPEC,
                        feedback_model="tests-options-feedback",
                        feedback_params={"temperature": 0.25},
                        feedback_budget=5,
                    )
                    assert answer.grad_fn is not None
                    assert answer.grad_fn.ctx.options == LLMOptions(
                        model=ModelRef(SPEC),
                        feedback_model=ModelRef("tests-options-feedback"),
                        feedback_params={"temperature": 0.25},
                        feedback_budget=5,
                    )
                    await answer.backward(
                        Variable("far too long, say only the number"), executor=executor
                    )
                    assert executor.stats.submitted == 2  # the forward and the backward
                worker.drain()
    finally:
        unregister_model("tests-options-feedback")
    # The worker condensed first (5 tokens of budget), then asked for the gradient, both
    # with the feedback model and its params.
    assert len(log) >= 2  # a summary request at least, then the gradient's
    assert all(name == "feedback" and params == {"temperature": 0.25} for name, params, _ in log)
    assert prompt.grad is not None
    assert "budget of 5 tokens" in prompt.grad.data


def _messages(error: BaseException) -> str:
    """Every message in an error's tree (groups, causes), for what the caller gets to see."""
    seen: list[str] = []
    visited: set[int] = set()
    stack: list[BaseException] = [error]
    while stack:
        exc = stack.pop()
        if id(exc) in visited:
            continue
        visited.add(id(exc))
        seen.append(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        stack.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)
    return "\n".join(seen)


async def test_a_model_object_fails_early_or_with_what_to_do_on_a_worker(redis_url: str) -> None:
    prompt = Parameter("Answer the question.", role="system prompt")
    answer = await llm_call(prompt, "What is 1 + 1?", model=SimulatedModel(latency_s=0.0))
    # Early: the caller can check the graph before anything is sent.
    with pytest.raises(ValueError, match="only this process knows"):
        check_portable(answer)
    # Late: without the check, the worker's error tells the caller what to do. This worker
    # shares our process, so forget the instance here, as another process never knew it.
    node = answer.grad_fn
    assert node is not None
    unregister_model(node.ctx.options.model.spec)
    worker = Worker(
        WorkerConfig(redis_url, queue="text-tests-object", lease_ms=1000),
        build_registry(["asyncgraph.text"]),
    )
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)
            with pytest.raises(BaseException) as info:
                async with open_redis_executor(
                    redis_url, queue="text-tests-object", timeout_s=20
                ) as executor:
                    await answer.backward(Variable("too long"), executor=executor)
            worker.drain()
    text = _messages(info.value)
    assert "UnknownModelError" in text and "model objects cannot travel between processes" in text
    assert "register_model(name, model)" in text and "--import your_module" in text
