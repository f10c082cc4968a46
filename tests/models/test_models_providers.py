"""Model specs as the ecosystem writes them, the base-URL policy for every provider, and
prompt-cache accounting (OpenAI's cached tokens, priced; old cached answers still load)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncgraph.models import (
    AnthropicChat,
    AzureOpenAIChat,
    Completion,
    ModelConfigError,
    OpenAIChat,
    Pricing,
    SimulatedModel,
    Usage,
    parse_model_spec,
)
from asyncgraph.models._prices import PRICES, default_pricing
from asyncgraph.models._spec import check_base_url, restrict_base_urls, split_model_spec
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.models._testing_providers import AnthropicTestServer
from asyncgraph.text import resolve_model, unregister_model

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "hello there"}]
PROVIDER_VARIABLES = (
    "OPENAI_BASE_URL",
    "ANTHROPIC_BASE_URL",
    "AZURE_OPENAI_ENDPOINT",
    "AZURE_OPENAI_API_VERSION",
    "OPENAI_API_VERSION",
    "ASYNCGRAPH_MODEL_PRICES",
    "ASYNCGRAPH_ALLOWED_BASE_URLS",
)


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in PROVIDER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test-000000")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-000000")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-test-000000")
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", "https://res.openai.azure.com/")


@pytest.mark.parametrize(
    ("spec", "cls", "name"),
    [
        ("openai:gpt-4o-mini", OpenAIChat, "gpt-4o-mini"),
        ("openai/gpt-4o-mini", OpenAIChat, "gpt-4o-mini"),
        ("OpenAI/gpt-4o-mini", OpenAIChat, "gpt-4o-mini"),
        ("openai/meta-llama/Llama-3-8B", OpenAIChat, "meta-llama/Llama-3-8B"),
        ("openai:meta-llama/Llama-3-8B", OpenAIChat, "meta-llama/Llama-3-8B"),
        ("openai/llama3:8b", OpenAIChat, "llama3:8b"),
        ("anthropic:claude-sonnet-4-20250514", AnthropicChat, "claude-sonnet-4-20250514"),
        ("anthropic/claude-3-5-haiku-latest", AnthropicChat, "claude-3-5-haiku-latest"),
        ("azure:prod-mini", AzureOpenAIChat, "prod-mini"),
        ("azure/prod-mini", AzureOpenAIChat, "prod-mini"),
        ("simulated/0.01", SimulatedModel, "simulated"),
    ],
)
def test_provider_colon_and_provider_slash_name_the_same_model(
    keys: None, spec: str, cls: type, name: str
) -> None:
    model = parse_model_spec(spec, cache=None, rate_limit=None)
    assert type(model) is cls and model.name == name


@pytest.mark.parametrize(
    ("spec", "write"),
    [
        ("gpt-4o-mini", "'openai:gpt-4o-mini' (or 'openai/gpt-4o-mini')"),
        ("o3-mini", "'openai:o3-mini'"),
        ("claude-sonnet-4-20250514", "'anthropic:claude-sonnet-4-20250514'"),
    ],
)
def test_a_bare_well_known_name_gets_the_spec_to_write(spec: str, write: str) -> None:
    with pytest.raises(ValueError, match="names no provider") as refused:
        parse_model_spec(spec)
    assert write in str(refused.value)


def test_an_unknown_provider_and_a_missing_model_are_named() -> None:
    with pytest.raises(ValueError, match="'gemini' is not a provider") as unknown:
        parse_model_spec("gemini/gemini-1.5-pro")
    assert "openai, anthropic, azure" in str(unknown.value)
    with pytest.raises(ValueError, match="write 'openai/meta-llama/Llama-3-8B'"):
        parse_model_spec("meta-llama/Llama-3-8B")
    for spec, form in (("anthropic/", "anthropic:MODEL"), ("azure:", "azure:DEPLOYMENT")):
        with pytest.raises(ValueError, match=f"names no model: write {form}"):
            parse_model_spec(spec)
    assert split_model_spec(" Azure / prod ") == ("azure", "prod")


def test_spec_built_models_take_the_dated_price_table_but_an_azure_deployment_does_not(
    keys: None,
) -> None:
    claude = parse_model_spec("anthropic/claude-sonnet-4-20250514", cache=None, rate_limit=None)
    assert claude.pricing == PRICES["claude-sonnet-4"] == Pricing(3.00, 15.00, 0.30, 3.75)
    named_like_a_model = parse_model_spec("azure/gpt-4o-mini", cache=None, rate_limit=None)
    assert named_like_a_model.pricing is None
    assert default_pricing("gpt-4o-mini", table=False) is None


def test_the_worker_policy_allows_each_providers_default_and_environment_urls_only(
    keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://claude-gw.internal")
    restriction = restrict_base_urls(["http://vllm:8000/v1"])
    try:
        for allowed in (
            "https://api.openai.com/v1",
            "https://api.anthropic.com/",
            "https://claude-gw.internal",
            "https://res.openai.azure.com",
            "http://vllm:8000/v1",
        ):
            check_base_url(allowed)
        # Built from a spec with the environment's endpoint: nothing from a task.
        assert isinstance(parse_model_spec("azure/prod", cache=None), AzureOpenAIChat)
        assert isinstance(parse_model_spec("anthropic/claude-x", cache=None), AnthropicChat)
        for spec in ("anthropic/claude-x", "azure/prod", "openai/gpt-4o"):
            with pytest.raises(ModelConfigError, match=r"--allow-base-url https://evil\.example"):
                parse_model_spec(spec, base_url="https://evil.example", cache=None)
        with pytest.raises(ModelConfigError, match="not allowed"):
            parse_model_spec("azure/prod", base_url="https://other.openai.azure.com")
    finally:
        restriction.remove()
    check_base_url("https://evil.example")  # unrestricted again


async def test_openai_cached_prompt_tokens_are_read_and_priced_at_the_cached_rate() -> None:
    with OpenAITestServer() as server:
        server.script(Reply(usage={"prompt_tokens_details": {"cached_tokens": 1}}))
        pricing = Pricing(2.50, 10.00, cached_input_usd_per_1m=1.25)
        model = OpenAIChat("gpt-4o", base_url=server.url, api_key="sk-test", pricing=pricing)
        async with model:
            answer = await model.complete(HELLO)
            usage = model.usage.snapshot()
    assert (answer.prompt_tokens, answer.cache_read_tokens, answer.cache_write_tokens) == (2, 1, 0)
    assert usage.cache_read_tokens == 1
    assert usage.cost_usd == pytest.approx((1 * 2.50 + 1 * 1.25 + 3 * 10.00) / 1e6)


def test_pricing_bills_reads_and_writes_at_their_rates_and_defaults_to_the_input_rate() -> None:
    priced = Pricing(3.0, 15.0, cached_input_usd_per_1m=0.3, cache_write_usd_per_1m=3.75)
    assert priced.cost_usd(1000, 100, cache_read_tokens=600, cache_write_tokens=300) == (
        pytest.approx((100 * 3.0 + 600 * 0.3 + 300 * 3.75 + 100 * 15.0) / 1e6)
    )
    plain = Pricing(3.0, 15.0)
    assert plain.cost_usd(1000, 100, 600, 300) == plain.cost_usd(1000, 100)
    # Counts a server reported inconsistently never make a negative share.
    assert priced.cost_usd(10, 0, cache_read_tokens=50) == pytest.approx(10 * 0.3 / 1e6)
    with pytest.raises(ValueError, match="prices must be >= 0"):
        Pricing(1.0, 1.0, cached_input_usd_per_1m=-1.0)


def test_cache_counts_travel_in_completions_and_usage_and_old_records_still_load() -> None:
    completion = Completion("t", "m", 10, 2, "stop", cache_read_tokens=4, cache_write_tokens=3)
    assert Completion.from_dict(completion.to_dict()) == completion
    old = {"text": "t", "model": "m", "prompt_tokens": 10, "completion_tokens": 2}
    assert Completion.from_dict(old).cache_read_tokens == 0
    usage = Usage(requests=1, prompt_tokens=10, cache_read_tokens=4, cache_write_tokens=3)
    assert Usage.from_dict(usage.to_dict()) == usage
    assert Usage.from_dict({"requests": 1}).cache_write_tokens == 0  # an older worker's report


def test_the_providers_page_names_tests_that_exist() -> None:
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "reference" / "providers.md").read_text()
    named = 0
    for row in page.splitlines():
        current: str | None = None
        for ref in re.findall(r"`((?:tests/models/)?(?:test_\w+\.py)?::test_\w+)`", row):
            path, _, test = ref.partition("::")
            current = Path(path).name if path else current
            assert current is not None, ref
            source = (root / "tests" / "models" / current).read_text()
            assert f"def {test}(" in source, ref
            named += 1
    assert named >= 20


async def test_a_worker_resolves_an_anthropic_spec_to_its_environments_endpoint_only(
    keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a worker does with a task naming "anthropic/...": resolve it under its
    # base-URL restriction, with its own key and ANTHROPIC_BASE_URL.
    with AnthropicTestServer(api_key="sk-ant-test-000000") as claude:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", claude.url)
        restriction = restrict_base_urls([])
        try:
            model = resolve_model("anthropic/claude-worker-test")
            assert isinstance(model, AnthropicChat)
            answer = await model.complete(HELLO)
            with pytest.raises(ModelConfigError, match="not allowed in this process"):
                resolve_model("anthropic/claude-worker-test", base_url="http://127.0.0.1:9")
        finally:
            restriction.remove()
            unregister_model("anthropic/claude-worker-test")
            await model.aclose()
    assert answer.text == "echo: hello there"
    assert claude.requests[0].headers["x-api-key"] == "sk-ant-test-000000"


def test_a_litellm_style_string_of_another_provider_is_told_to_go_through_litellm() -> None:
    from asyncgraph.models import parse_model_spec

    with pytest.raises(ValueError, match=r"write 'litellm/gemini/gemini-2\.0-flash'"):
        parse_model_spec("gemini/gemini-2.0-flash")
