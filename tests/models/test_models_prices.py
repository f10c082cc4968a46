"""Cost you can trust: a dated price table for spec-built models, overrides, "unknown"."""

from __future__ import annotations

import datetime
import re

import pytest

from asyncgraph.models import (
    ModelConfigError,
    Pricing,
    SimulatedModel,
    Usage,
    format_cost,
    parse_model_spec,
)
from asyncgraph.models._prices import (
    ENV_PRICES,
    PRICES,
    PRICES_DATE,
    PRICES_SOURCE,
    default_pricing,
)
from asyncgraph.models._testing import OpenAITestServer

pytestmark = pytest.mark.anyio


def test_the_table_is_dated_and_names_its_source() -> None:
    assert datetime.date.fromisoformat(PRICES_DATE) <= datetime.date.today()
    assert PRICES_SOURCE.startswith("https://")
    assert PRICES["gpt-4o-mini"] == Pricing(0.15, 0.60, cached_input_usd_per_1m=0.075)
    assert PRICES["claude-sonnet-4"] == Pricing(3.00, 15.00, 0.30, 3.75)
    assert all(p.input_usd_per_1m > 0 and p.output_usd_per_1m > 0 for p in PRICES.values())


def test_a_spec_built_model_takes_the_table_price_a_dated_snapshot_its_family_price(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_PRICES, raising=False)
    assert parse_model_spec("openai:gpt-4o", api_key="k").pricing == PRICES["gpt-4o"]
    snapshot = parse_model_spec("openai:gpt-4o-mini-2024-07-18", api_key="k")
    assert snapshot.pricing == PRICES["gpt-4o-mini"]
    assert parse_model_spec("openai:llama3", base_url="http://127.0.0.1:9/v1").pricing is None
    explicit = Pricing(1.0, 2.0)
    assert parse_model_spec("openai:gpt-4o", api_key="k", pricing=explicit).pricing == explicit


def test_the_environment_overrides_the_table_and_prices_unknown_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_PRICES, "gpt-4o=1/4, llama3 = 0/0")
    assert parse_model_spec("openai:gpt-4o", api_key="k").pricing == Pricing(1.0, 4.0)
    assert default_pricing("llama3") == Pricing(0.0, 0.0)
    assert default_pricing("gpt-4o-mini") == PRICES["gpt-4o-mini"]  # the table for the rest
    explicit = Pricing(9.0, 9.0)
    assert parse_model_spec("openai:gpt-4o", api_key="k", pricing=explicit).pricing == explicit


@pytest.mark.parametrize("raw", ["gpt-4o", "gpt-4o=1", "gpt-4o=a/b", "gpt-4o=-1/2", "=1/2"])
def test_a_malformed_price_variable_is_named_with_an_example(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_PRICES, raw)
    with pytest.raises(ModelConfigError, match=rf"{ENV_PRICES}: entry .* NAME=IN/OUT.*e\.g\."):
        default_pricing("gpt-4o")


async def test_a_model_without_a_price_reports_its_cost_as_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_PRICES, raising=False)
    with OpenAITestServer() as server:
        priced = parse_model_spec("openai:gpt-4o-mini", base_url=server.url)
        unknown = parse_model_spec("openai:my-finetune", base_url=server.url)
        async with priced, unknown:
            await priced.complete([{"role": "user", "content": "a b c"}])
            await unknown.complete([{"role": "user", "content": "a b c"}])
    assert priced.usage.snapshot().unpriced_requests == 0
    assert priced.usage.snapshot().cost_text.startswith("$0.00")
    spent = unknown.usage.snapshot()
    assert spent.unpriced_requests == 1 and spent.cost_usd == 0.0
    assert spent.cost_text == "cost unknown"
    both = priced.usage.snapshot() + spent
    assert both.cost_text.endswith(" + unknown") and both.cost_text.startswith("$")


async def test_the_simulated_model_is_free_by_definition() -> None:
    model = SimulatedModel(latency_s=0)
    await model.complete([{"role": "user", "content": "hi"}])
    spent = model.usage.snapshot()
    assert spent.unpriced_requests == 0 and spent.cost_usd == 0.0
    assert spent.cost_text == "$0"


@pytest.mark.parametrize(
    ("cost", "unpriced", "text"),
    [
        (0.0, 0, "$0"),
        (0.0123, 0, "$0.0123"),
        (12.345, 0, "$12.35"),
        (0.0, 3, "cost unknown"),
        (0.5, 1, "$0.5000 + unknown"),
    ],
)
def test_format_cost_never_shows_an_unknown_price_as_zero(
    cost: float, unpriced: int, text: str
) -> None:
    assert format_cost(cost, unpriced) == text
    assert not re.fullmatch(r"\$0\.0+", format_cost(0.0, unpriced))


def test_usage_on_the_wire_keeps_the_fields_the_schema_knows() -> None:
    usage = Usage(requests=2, unpriced_requests=1, cost_usd=0.5)
    data = usage.to_dict()
    assert "unpriced_requests" not in data
    assert Usage.from_dict(data) == Usage(requests=2, cost_usd=0.5)
    assert Usage.from_dict({**data, "unpriced_requests": 1}) == usage


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("cost_usd", float("nan"), "'cost_usd' must be a finite number >= 0"),
        ("cost_usd", float("inf"), "'cost_usd' must be a finite number >= 0"),
        ("cost_usd", -0.5, "'cost_usd' must be a finite number >= 0"),
        ("prompt_tokens", 10**15, "'prompt_tokens' must be from 0 to 100,000,000"),
        ("requests", -1, "'requests' must be from 0 to 100,000,000"),
        ("completion_tokens", 1.5, "'completion_tokens' must be an int"),
        ("completion_tokens", float("nan"), "'completion_tokens' must be an int"),
    ],
)
def test_a_usage_report_out_of_range_is_refused(field: str, value: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Usage.from_dict({"requests": 1, field: value})


def test_a_workers_usage_report_with_a_nan_cost_is_ignored_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What a client does with a reply's usage (the "models" task hook): a NaN cost would
    # make every `cost_usd > cap` false; the report is refused, the totals stay, a warning.
    from asyncgraph.distributed._executor import _on_reply_metadata
    from asyncgraph.models import track_usage

    with track_usage() as meter:
        _on_reply_metadata({"models": {"requests": 1, "cost_usd": 0.25}})
        with caplog.at_level("WARNING", logger="asyncgraph"):
            _on_reply_metadata({"models": {"requests": 1, "cost_usd": float("nan")}})
            _on_reply_metadata({"models": {"requests": 1, "prompt_tokens": 10**15}})
    assert meter.snapshot() == Usage(requests=1, cost_usd=0.25)
    warnings = [r.getMessage() for r in caplog.records if "malformed 'models'" in r.getMessage()]
    assert len(warnings) == 2 and "finite number" in warnings[0], warnings
