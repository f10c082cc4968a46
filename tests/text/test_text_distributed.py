"""The text Functions' backwards on a real worker, through a real Redis.

The worker serves ``--import asyncgraph.text`` and resolves the model spec
``"simulated:0"`` itself (the builtin simulated replies are a deterministic
function of the messages), so the remote gradients must equal the local ones.
"""

from __future__ import annotations

import anyio
import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.executors import open_redis_executor
from asyncgraph.text import TextLoss, concat, llm_call
from asyncgraph.worker import Worker, WorkerConfig, build_registry

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
            async with open_redis_executor(
                redis_url, queue="text-tests", timeout_s=20
            ) as executor:
                await total.backward(executor=executor)
                assert executor.stats.submitted == 6  # 3 judges + 3 answers; concat stays local
            worker.drain()

    assert prompt.grad is not None and draft.grad is not None
    assert local_prompt.grad is not None and local_draft.grad is not None
    assert prompt.grad.data == local_prompt.grad.data
    assert draft.grad.data == local_draft.grad.data
    assert len(prompt.grad.data) == 3
