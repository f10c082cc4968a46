"""``litellm:`` / ``litellm/`` specs: LiteLLM in-process, offline with its mock responses."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from asyncgraph import Parameter, Variable, backward
from asyncgraph.models import (
    BaseChatModel,
    ModelConfigError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelRetryError,
    Pricing,
    Retry,
    parse_model_spec,
)
from asyncgraph.text import llm_call

# LiteLLM fetches its price map from the network when imported, unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@functools.cache
def _litellm() -> Any:
    """LiteLLM, imported when a test first needs it (its import takes seconds: a test
    run that selects none of these tests does not pay it)."""
    import litellm

    # Importing LiteLLM adds its own redaction filter to httpx's logger, for the whole
    # process: the tests of asyncgraph's own redaction of those lines must not see it.
    for found in list(logging.getLogger("httpx").filters):
        if type(found).__module__.startswith("litellm"):
            logging.getLogger("httpx").removeFilter(found)
    return litellm


@pytest.fixture
def litellm() -> Any:
    return _litellm()


needs_litellm = pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None, reason="the litellm extra is not installed"
)

pytestmark = [
    pytest.mark.anyio,
    # LiteLLM's own imports (pydantic schemas of its auth flows); nothing of asyncgraph.
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]


def test_without_litellm_a_spec_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "litellm", None)  # an import of it fails
    with pytest.raises(ModelConfigError, match=r"pip install 'asyncgraph\[litellm\]'"):
        parse_model_spec("litellm:gpt-4o-mini")


@pytest.mark.slow
def test_asyncgraph_imports_without_litellm() -> None:
    code = (
        "import sys; sys.modules['litellm'] = None\n"
        "import asyncgraph.models, asyncgraph.text\n"
        "try:\n"
        "    asyncgraph.models.parse_model_spec('litellm:gpt-4o-mini')\n"
        "except asyncgraph.models.ModelConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'asyncgraph[litellm]'" in out.stdout, out.stderr


@needs_litellm
def test_a_missing_api_key_is_named_before_the_first_call(
    litellm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LiteLLM reads the provider's key itself at the call: ``missing_api_keys`` names the
    variable beforehand (the demo checks it before its banner), and nothing is missing
    when a key, a base URL or an offline mock answer is given."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert parse_model_spec("litellm:gpt-4o-mini").missing_api_keys() == ["OPENAI_API_KEY"]
    assert parse_model_spec("litellm:gpt-4o-mini", api_key="sk-x").missing_api_keys() == []
    assert mocked("litellm:gpt-4o-mini", "hi").missing_api_keys() == []
    local = parse_model_spec("litellm:openai/m", base_url="http://127.0.0.1:9/v1")
    assert local.missing_api_keys() == []
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    assert parse_model_spec("litellm:gpt-4o-mini").missing_api_keys() == []


@needs_litellm
def test_the_demo_with_a_litellm_model_and_no_key_is_one_line_before_anything(
    litellm: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.cli import main

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["demo", "--model", "litellm:gpt-4o-mini"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # no banner, no LiteLLM help block
    assert captured.err.count("\n") == 1, captured.err
    assert "OPENAI_API_KEY is not set: LiteLLM needs it to call 'litellm:gpt-4o-mini'" in (
        captured.err
    )


HELLO = [{"role": "user", "content": "hello there"}]


def mocked(spec: str, reply: object, **options: object) -> BaseChatModel:
    return parse_model_spec(spec, default_params={"mock_response": reply}, **options)


@needs_litellm
@pytest.mark.parametrize(
    "spec", ["litellm:gpt-4o-mini", "litellm/gpt-4o-mini", "LiteLLM:gpt-4o-mini"]
)
def test_both_spec_forms_build_a_litellm_model_priced_from_litellms_map(
    spec: str, litellm: Any
) -> None:
    model = parse_model_spec(spec)
    assert type(model).__name__ == "LiteLLMChat" and model.name == "gpt-4o-mini"
    info = litellm.get_model_info("gpt-4o-mini")
    assert model.pricing == Pricing(
        info["input_cost_per_token"] * 1e6,
        info["output_cost_per_token"] * 1e6,
        cached_input_usd_per_1m=info["cache_read_input_token_cost"] * 1e6,
    )


@needs_litellm
def test_a_provider_prefix_stays_in_litellms_model_name(litellm: Any) -> None:
    model = parse_model_spec("litellm/anthropic/claude-3-5-haiku-20241022")
    assert model.name == "anthropic/claude-3-5-haiku-20241022"
    with pytest.raises(ValueError, match=r"litellm:MODEL or litellm/MODEL"):
        parse_model_spec("litellm:")


@needs_litellm
async def test_a_call_returns_litellms_text_usage_and_cost(litellm: Any) -> None:
    async with mocked("litellm:gpt-4o-mini", "Paris is the capital.") as model:
        answer = await model.complete(HELLO, temperature=0)
        usage = model.usage.snapshot()
    response = litellm.completion(
        model="gpt-4o-mini", messages=HELLO, mock_response="Paris is the capital."
    )
    assert answer.text == "Paris is the capital." and answer.finish_reason == "stop"
    assert (answer.prompt_tokens, answer.completion_tokens) == (
        response.usage.prompt_tokens,
        response.usage.completion_tokens,
    )
    assert usage.requests == 1
    assert usage.cost_usd == pytest.approx(response._hidden_params["response_cost"])
    assert usage.cost_usd == pytest.approx(litellm.completion_cost(completion_response=response))


@needs_litellm
async def test_prices_from_the_environment_win_over_litellms(litellm: Any) -> None:
    os.environ["ASYNCGRAPH_MODEL_PRICES"] = "gpt-4o-mini=1/2"
    try:
        model = mocked("litellm:gpt-4o-mini", "ok")
    finally:
        del os.environ["ASYNCGRAPH_MODEL_PRICES"]
    assert model.pricing == Pricing(1.0, 2.0)


@needs_litellm
async def test_a_rate_limit_is_retried_and_a_bad_request_is_not(litellm: Any) -> None:
    limited = litellm.RateLimitError("slow down", llm_provider="openai", model="gpt-4o-mini")
    model = mocked("litellm:gpt-4o-mini", limited, retry=Retry(max_attempts=2, backoff_base_s=0))
    with pytest.raises(ModelRetryError) as caught:
        await model.complete(HELLO)
    assert caught.value.attempts == 2
    assert isinstance(caught.value.last_error, ModelRateLimitedError)
    assert caught.value.last_error.status_code == 429
    bad = litellm.BadRequestError("no such param", llm_provider="openai", model="gpt-4o-mini")
    model = mocked("litellm:gpt-4o-mini", bad, retry=Retry(max_attempts=3, backoff_base_s=0))
    with pytest.raises(ModelRequestError, match="no such param") as request_error:
        await model.complete(HELLO)
    assert request_error.value.status_code == 400 and model.usage.snapshot().errors == 1


@needs_litellm
async def test_a_text_graph_runs_its_forward_and_backward_through_litellm(litellm: Any) -> None:
    model = mocked("litellm:gpt-4o-mini", "Be shorter.")
    prompt = Parameter("Answer.", role="system prompt")
    answer = await llm_call(prompt, "What is 2 + 2?", model=model)
    await backward(answer, Variable("too long"))
    assert answer.data == "Be shorter." and prompt.grad is not None
    assert model.usage.snapshot().requests == 2
