"""Process-level defaults for spec-built models, read from ASYNCGRAPH_MODEL_* variables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph.models import (
    DiskCache,
    LocalRateLimiter,
    MemoryCache,
    ModelConfigError,
    RedisCache,
    RedisRateLimiter,
    _spec,
    parse_model_spec,
)
from asyncgraph.models._spec import model_options_from_env

VARIABLES = (_spec.ENV_RPM, _spec.ENV_TPM, _spec.ENV_RATE_REDIS, _spec.ENV_CACHE)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No ASYNCGRAPH_MODEL_* from the outer environment, and fresh process-wide state."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_spec, "_caches", {})
    monkeypatch.setattr(_spec, "_local_limiters", {})
    yield monkeypatch


def test_without_settings_spec_models_have_no_limit_and_no_cache() -> None:
    model = parse_model_spec("simulated:0")
    assert model.rate_limiter is None and model.cache is None
    assert model_options_from_env("simulated") == {}


def test_rate_limit_is_shared_by_the_spec_models_of_one_name(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(_spec.ENV_RPM, "600")
    clean_env.setenv(_spec.ENV_TPM, "150000")
    a = parse_model_spec("openai:gpt-x", base_url="http://127.0.0.1:1/v1")
    b = parse_model_spec("openai:gpt-x", base_url="http://127.0.0.1:2/v1")
    other = parse_model_spec("openai:gpt-y", base_url="http://127.0.0.1:1/v1")
    assert isinstance(a.rate_limiter, LocalRateLimiter)
    assert a.rate_limiter is b.rate_limiter  # one budget for the model name in this process
    assert other.rate_limiter is not a.rate_limiter
    limit = a.rate_limiter.limit
    assert (limit.requests_per_minute, limit.tokens_per_minute) == (600.0, 150000.0)


def test_explicit_options_win_over_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(_spec.ENV_RPM, "600")
    clean_env.setenv(_spec.ENV_CACHE, "memory")
    model = parse_model_spec("simulated:0", rate_limit=None, cache=None)
    assert model.rate_limiter is None and model.cache is None


@pytest.mark.parametrize(
    ("setting", "kind"),
    [
        ("memory", MemoryCache),
        ("disk:{tmp}/cache", DiskCache),
        ("redis://127.0.0.1:1/0", RedisCache),
    ],
)
def test_cache_forms(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, setting: str, kind: type
) -> None:
    clean_env.setenv(_spec.ENV_CACHE, setting.format(tmp=tmp_path))
    a, b = parse_model_spec("simulated:0"), parse_model_spec("simulated:0.01")
    assert isinstance(a.cache, kind) and a.cache is b.cache
    if isinstance(a.cache, DiskCache):
        assert a.cache.directory == tmp_path / "cache"


@pytest.mark.anyio
async def test_memory_cache_from_the_environment_answers_repeats(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv(_spec.ENV_CACHE, "memory")
    a, b = parse_model_spec("simulated:0"), parse_model_spec("simulated:0")
    await a.complete(HELLO)
    assert (await b.complete(HELLO)).cached


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (_spec.ENV_RPM, "lots", "is not a number > 0"),
        (_spec.ENV_RPM, "0", "is not a number > 0"),
        (_spec.ENV_TPM, "-5", "is not a number > 0"),
        (_spec.ENV_TPM, "inf", "is not a number > 0"),
        (_spec.ENV_RPM, "0.5", "do not make a valid rate limit"),
        (_spec.ENV_CACHE, "sqlite:/tmp/x", "is not a cache"),
        (_spec.ENV_CACHE, "disk:", "is not a cache"),
        (_spec.ENV_RATE_REDIS, "redis://localhost:6379/0", "neither"),
    ],
)
def test_invalid_settings_raise_a_clear_error(
    clean_env: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    clean_env.setenv(variable, value)
    with pytest.raises(ModelConfigError, match=message) as info:
        parse_model_spec("simulated")
    assert info.value.variable == variable and variable in str(info.value)
    assert isinstance(info.value, ValueError)


def test_rate_redis_must_be_a_redis_url(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(_spec.ENV_RPM, "60")
    clean_env.setenv(_spec.ENV_RATE_REDIS, "localhost:6379")
    with pytest.raises(ModelConfigError, match="is not a Redis URL"):
        parse_model_spec("simulated")


@pytest.mark.anyio
async def test_rate_limit_is_shared_through_redis(
    clean_env: pytest.MonkeyPatch, redis_url: str
) -> None:
    # Two spec-built models stand for two workers: with ASYNCGRAPH_MODEL_RATE_REDIS they
    # book from one budget in Redis (the cross-process case is test_models_ratelimit's).
    clean_env.setenv(_spec.ENV_RPM, "60")  # one request per second
    clean_env.setenv(_spec.ENV_RATE_REDIS, redis_url)
    a, b = parse_model_spec("simulated:0"), parse_model_spec("simulated:0")
    try:
        assert isinstance(a.rate_limiter, RedisRateLimiter)
        assert isinstance(b.rate_limiter, RedisRateLimiter)
        assert a.rate_limiter is not b.rate_limiter
        assert a.rate_limiter.name == b.rate_limiter.name == "simulated"
        await a.complete(HELLO)  # takes the first slot
        assert 0.5 < await b.rate_limiter.reserve() <= 1.1
    finally:
        await a.aclose()
        await b.aclose()


def test_a_refused_base_url_is_named_without_its_credentials() -> None:
    from asyncgraph.models._spec import check_base_url, restrict_base_urls

    url = "http://u:ref-pass-1@llm:8000/v1?api-key=ref-key-2"
    allowed = restrict_base_urls(["http://op:ref-pass-3@allowed:8000/v1"])
    try:
        with pytest.raises(ModelConfigError) as refused:
            check_base_url(url)
    finally:
        allowed.remove()
    shown = f"{refused.value} {refused.value.value}"
    assert "--allow-base-url http://u:***@llm:8000/v1?api-key=***" in shown
    for secret in ("ref-pass-1", "ref-key-2", "ref-pass-3"):
        assert secret not in shown
