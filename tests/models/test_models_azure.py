"""AzureOpenAIChat against a strict local fake of Azure OpenAI's deployment routes."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from asyncgraph.models import (
    AzureOpenAIChat,
    ModelConfigError,
    ModelRequestError,
    Pricing,
    Retry,
    parse_model_spec,
)
from asyncgraph.models._testing import Reply
from asyncgraph.models._testing_providers import AzureOpenAITestServer

pytestmark = pytest.mark.anyio

KEY = "azure-key-0123456789abcdef"
TOKEN = "entra-token-0123456789"
HELLO = [{"role": "user", "content": "hello there"}]
AZURE_VARIABLES = (
    "AZURE_OPENAI_ENDPOINT",
    "AZURE_OPENAI_API_KEY",
    "AZURE_OPENAI_AD_TOKEN",
    "AZURE_OPENAI_API_VERSION",
    "OPENAI_API_VERSION",
    "ASYNCGRAPH_MODEL_PRICES",
)


@pytest.fixture
def azure(monkeypatch: pytest.MonkeyPatch) -> Iterator[AzureOpenAITestServer]:
    for variable in AZURE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    with AzureOpenAITestServer(
        deployments={"prod-mini": "gpt-4o-mini-2024-07-18"}, api_key=KEY, ad_token=TOKEN
    ) as srv:
        yield srv


async def test_a_spec_posts_to_the_deployment_with_the_environments_endpoint_key_and_version(
    azure: AzureOpenAITestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", azure.url + "/")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", KEY)
    monkeypatch.setenv("AZURE_OPENAI_API_VERSION", "2025-01-01-preview")
    for spec in ("azure/prod-mini", "azure:prod-mini"):
        model = parse_model_spec(spec, cache=None, rate_limit=None)
        assert isinstance(model, AzureOpenAIChat)
        async with model:
            answer = await model.complete(HELLO, temperature=0)
        assert answer.text == "echo: hello there"
        assert answer.model == "gpt-4o-mini-2024-07-18"  # what the deployment serves
        assert model.pricing is None  # a deployment's name is not a price-table name
    request = azure.requests[-1]
    assert request.path == (
        "/openai/deployments/prod-mini/chat/completions?api-version=2025-01-01-preview"
    )
    assert request.headers["api-key"] == KEY and "authorization" not in request.headers
    assert request.body == {"messages": HELLO, "temperature": 0}  # no "model": the URL names it
    assert azure.statuses() == [200, 200]


def test_the_api_version_comes_from_the_argument_then_litellms_then_the_sdks_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in AZURE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    endpoint = "https://res.openai.azure.com"

    def version(**options: str) -> str:
        return AzureOpenAIChat("d", endpoint, "k", **options).api_version

    assert version() == "2024-10-21"
    monkeypatch.setenv("OPENAI_API_VERSION", "2024-06-01")
    assert version() == "2024-06-01"
    monkeypatch.setenv("AZURE_OPENAI_API_VERSION", "2024-08-01-preview")
    assert version() == "2024-08-01-preview"
    assert version(api_version="2024-02-01") == "2024-02-01"
    model = AzureOpenAIChat("d", endpoint, "k")
    assert model.url == (
        "https://res.openai.azure.com/openai/deployments/d/chat/completions"
        "?api-version=2024-08-01-preview"
    )


async def test_an_entra_id_token_is_sent_as_a_bearer(azure: AzureOpenAITestServer) -> None:
    async with AzureOpenAIChat("prod-mini", azure.url, azure_ad_token=TOKEN) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    headers = azure.requests[0].headers
    assert headers["authorization"] == f"Bearer {TOKEN}" and "api-key" not in headers


async def test_azures_errors_are_read_a_wrong_key_and_an_unknown_deployment(
    azure: AzureOpenAITestServer,
) -> None:
    async with AzureOpenAIChat("prod-mini", azure.url, "wrong-key-000000") as model:
        with pytest.raises(ModelRequestError) as denied:
            await model.complete(HELLO)
    assert denied.value.status_code == 401
    assert denied.value.server_message.startswith("Access denied due to invalid subscription key")
    assert "AZURE_OPENAI_API_KEY" in str(denied.value)
    async with AzureOpenAIChat("nope", azure.url, KEY) as model:
        with pytest.raises(ModelRequestError) as missing:
            await model.complete(HELLO)
    assert missing.value.status_code == 404
    assert "API deployment for this resource does not exist" in missing.value.server_message
    assert "check the deployment name" in str(missing.value)


async def test_a_429_is_retried_after_retry_after_and_cached_prompt_tokens_are_priced(
    azure: AzureOpenAITestServer,
) -> None:
    azure.script(
        Reply(status=429, headers={"Retry-After": "0"}, error="Requests ... exceeded"),
        Reply(usage={"prompt_tokens_details": {"cached_tokens": 2}}),
    )
    pricing = Pricing(0.15, 0.60, cached_input_usd_per_1m=0.075)
    retry = Retry(max_attempts=2, backoff_base_s=0.005)
    async with AzureOpenAIChat("prod-mini", azure.url, KEY, retry=retry, pricing=pricing) as model:
        answer = await model.complete(HELLO)
        usage = model.usage.snapshot()
    assert azure.statuses() == [429, 200]
    assert (answer.prompt_tokens, answer.cache_read_tokens, answer.completion_tokens) == (2, 2, 3)
    assert usage.cache_read_tokens == 2 and usage.retries == 1
    assert usage.cost_usd == pytest.approx((2 * 0.075 + 3 * 0.60) / 1e6)


def test_a_missing_endpoint_or_credential_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in AZURE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ModelConfigError, match="AZURE_OPENAI_ENDPOINT is not set") as no_endpoint:
        parse_model_spec("azure/prod-mini")
    assert no_endpoint.value.variable == "AZURE_OPENAI_ENDPOINT"
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", "https://res.openai.azure.com")
    with pytest.raises(ModelConfigError, match="AZURE_OPENAI_API_KEY is not set"):
        parse_model_spec("azure/prod-mini")
    with pytest.raises(ModelConfigError, match="is not an http"):
        AzureOpenAIChat("d", "res.openai.azure.com", "k")
    monkeypatch.setenv("ASYNCGRAPH_MODEL_PRICES", "prod-mini=0.15/0.60/0.075")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", KEY)
    priced = parse_model_spec("azure/prod-mini")
    assert priced.pricing == Pricing(0.15, 0.60, 0.075)


async def test_the_key_is_never_logged_or_shown(
    azure: AzureOpenAITestServer, caplog: pytest.LogCaptureFixture
) -> None:
    azure.script(
        Reply(status=500, error="boom"),
        Reply(text=f"the key is {KEY}"),
        Reply(status=400, error=f"bad key {KEY}"),
    )
    retry = Retry(max_attempts=2, backoff_base_s=0.005)
    with caplog.at_level(logging.DEBUG):
        async with AzureOpenAIChat("prod-mini", azure.url, KEY, retry=retry) as model:
            answer = await model.complete(HELLO)
            with pytest.raises(ModelRequestError) as rejected:
                await model.complete(HELLO)
    assert "retrying" in caplog.text
    for text in (
        caplog.text,
        answer.text,
        str(rejected.value),
        repr(model),
        json.dumps(model.cache_request(HELLO, {})),
    ):
        assert KEY not in text, text
