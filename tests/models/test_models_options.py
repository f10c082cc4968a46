"""Model options and settings are checked where the model is built (#9 points 8 and 9)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from asyncgraph.models import (
    MemoryCache,
    ModelConfigError,
    OpenAIChat,
    RateLimit,
    Retry,
    SimulatedModel,
    parse_model_spec,
)
from asyncgraph.text import llm_call, resolve_model


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("cache", "memory"),
        ("cache", {"a": 1}),
        ("rate_limit", 600),
        ("rate_limit", {"rpm": 600}),
        ("retry", 3),
        ("retry", True),
        ("pricing", 0.01),
        ("usage", []),
    ],
)
def test_a_wrong_kind_of_option_is_a_type_error_naming_it_at_construction(
    option: str, value: Any
) -> None:
    for build in (
        lambda **kw: SimulatedModel(**kw),
        lambda **kw: OpenAIChat("m", base_url="http://127.0.0.1:9/v1", **kw),
    ):
        with pytest.raises(TypeError, match=rf"{option}= must be .* or None, got"):
            build(**{option: value})


def test_the_right_kinds_of_options_are_accepted() -> None:
    model = SimulatedModel(
        cache=MemoryCache(),
        rate_limit=RateLimit(requests_per_minute=600),
        retry=Retry(max_attempts=2),
    )
    assert model.retry.max_attempts == 2 and model.cache is not None


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return monkeypatch


def test_a_missing_api_key_is_reported_as_a_missing_api_key(no_key: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelConfigError, match="OPENAI_API_KEY is not set") as info:
        parse_model_spec("openai:gpt-4o-mini")
    assert info.value.variable == "OPENAI_API_KEY"
    # Through the text layer too: not "unknown model ... register_model".
    with pytest.raises(ModelConfigError, match="OPENAI_API_KEY is not set"):
        resolve_model("openai:gpt-4o-mini")
    # A local server that needs no key is fine.
    assert parse_model_spec("openai:llama", base_url="http://127.0.0.1:9/v1") is not None


@pytest.mark.anyio
async def test_a_missing_api_key_fails_before_any_model_call(no_key: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelConfigError, match="OPENAI_API_KEY is not set"):
        await llm_call("Be brief.", "hi", model="openai:gpt-4o-mini-nokey")


@pytest.mark.slow
def test_demo_with_a_real_model_and_no_key_says_so_before_any_step(tmp_path: Any) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
    done = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "demo", "--model", "openai:gpt-4o-mini"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: OPENAI_API_KEY is not set")
    assert "step" not in done.stdout


@pytest.mark.parametrize("url", ["ftp://example.com/v1", "localhost:8000/v1", "not a url"])
def test_a_base_url_that_is_not_http_is_rejected_at_once(
    no_key: pytest.MonkeyPatch, url: str
) -> None:
    with pytest.raises(ModelConfigError, match="is not an http:// or https:// URL"):
        OpenAIChat("m", base_url=url, api_key="k")
    no_key.setenv("OPENAI_BASE_URL", url)
    with pytest.raises(ModelConfigError, match=r"OPENAI_BASE_URL .* is not an http"):
        OpenAIChat("m", api_key="k")


def test_openai_without_a_model_name_says_the_name_is_missing() -> None:
    for spec in ("openai:", "openai:  "):
        with pytest.raises(ValueError, match="names no model: write openai:MODEL"):
            parse_model_spec(spec)
