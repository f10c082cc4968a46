"""The README's first script and the demo job against a real local model server (#34).

Skipped unless ``ASYNCGRAPH_REAL_SERVER_URL`` names an OpenAI-compatible server's base URL
(llama.cpp's ``llama-server``, vLLM...; ``ASYNCGRAPH_REAL_SERVER_MODEL`` its model name,
default ``local-model``). Not needed by CI: ``benchmarks/bench_real_server.py`` prints the
figures. Both must complete with no timeout and no request refused for its size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import run_job
from asyncgraph.jobs.demo import build_demo_job
from asyncgraph.models import ModelCall, OpenAIChat, observe_calls
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, llm_call, register_model, unregister_model, use_models

URL = os.environ.get("ASYNCGRAPH_REAL_SERVER_URL", "")
MODEL = os.environ.get("ASYNCGRAPH_REAL_SERVER_MODEL", "local-model")

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,
    pytest.mark.skipif(not URL, reason="set ASYNCGRAPH_REAL_SERVER_URL to a local server"),
    # A small model on two cores runs the demo's epoch in about 8 minutes, not the suite's 5.
    pytest.mark.timeout(3600),
]


def _model() -> OpenAIChat:
    """The model as a user builds it: the defaults (``timeout_s=60``, 4 attempts, the
    server's slots and window read from it)."""
    return OpenAIChat(MODEL, base_url=URL, api_key="")


def _clean(calls: list[ModelCall]) -> None:
    """No attempt timed out or was refused for its size, retried or not."""
    errors = [c.error for c in calls if c.error] + [e for c in calls for e in c.retried_after]
    assert not [e for e in errors if "ModelTimeoutError" in e], errors
    assert not [e for e in errors if "ModelContextError" in e], errors


async def test_the_readme_first_script_against_the_real_server() -> None:
    calls: list[ModelCall] = []
    async with _model() as model:
        with use_models(model), observe_calls(calls.append):
            prompt = Parameter("Answer the question.", role="system prompt")
            answer = await llm_call(prompt, Variable("What is 17 * 23?", role="question"))
            loss = await TextLoss("Is the answer correct? Be terse.")(answer)
            await loss.backward()
            tgd = TGD([prompt])
            await tgd.step()
    _clean(calls)
    assert tgd.skipped == [] and prompt.data != "Answer the question."


async def test_the_demo_job_one_epoch_against_the_real_server(tmp_path: Path) -> None:
    calls: list[ModelCall] = []
    model = _model()
    register_model("real-server", model)
    try:
        job, _ = build_demo_job("real-server", epochs=1)
        with observe_calls(calls.append):
            result = await run_job(job, tmp_path, progress=False)
    finally:
        unregister_model("real-server")
        await model.aclose()
    _clean(calls)
    assert result.steps_done == job.total_steps
