"""The public surface of asyncgraph.models: names, docs, protocol, model specs."""

from __future__ import annotations

import inspect

import pytest

import asyncgraph.models as models
from asyncgraph import AsyncGraphError
from asyncgraph.models import (
    BaseChatModel,
    ChatModel,
    Completion,
    DiskCache,
    LocalRateLimiter,
    MemoryCache,
    ModelError,
    OpenAIChat,
    RateLimit,
    RedisCache,
    RedisRateLimiter,
    SimulatedModel,
    parse_model_spec,
)
from asyncgraph.models._cache import Cache
from asyncgraph.models._ratelimit import RateLimiter


def test_all_is_sorted_and_every_name_is_importable_and_documented() -> None:
    assert models.__all__ == sorted(models.__all__)
    for name in models.__all__:
        obj = getattr(models, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


def test_every_model_error_roots_in_model_error_a_branch_of_asyncgraph_error() -> None:
    for name in models.__all__:
        obj = getattr(models, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, ModelError) and issubclass(obj, AsyncGraphError)


def test_models_and_backends_satisfy_their_protocols() -> None:
    assert isinstance(SimulatedModel(), ChatModel)
    assert isinstance(OpenAIChat("m", base_url="http://127.0.0.1:1/v1"), ChatModel)
    for cache in (MemoryCache(), DiskCache("/tmp/unused"), RedisCache("redis://127.0.0.1:1")):
        assert isinstance(cache, Cache)
    limit = RateLimit(requests_per_minute=60)
    assert isinstance(LocalRateLimiter(limit), RateLimiter)
    assert isinstance(
        RedisRateLimiter(limit, name="x", redis_url="redis://127.0.0.1:1"), RateLimiter
    )


@pytest.mark.anyio
async def test_a_third_party_model_needs_only_complete() -> None:
    class Upper(BaseChatModel):
        def __init__(self) -> None:
            super().__init__("upper")

        async def _complete_once(self, messages, params):  # type: ignore[no-untyped-def]
            return Completion(messages[-1]["content"].upper(), model="upper")

    model = Upper()
    assert isinstance(model, ChatModel)
    assert (await model.complete([{"role": "user", "content": "hi"}])).text == "HI"
    assert model.usage.snapshot().requests == 1


def test_parse_model_spec_forms() -> None:
    sim = parse_model_spec("simulated")
    assert isinstance(sim, SimulatedModel) and sim.latency_s == 0.1
    fast = parse_model_spec("simulated:0.01")
    assert isinstance(fast, SimulatedModel) and fast.latency_s == 0.01
    remote = parse_model_spec("openai:llama3", base_url="http://127.0.0.1:1/v1", timeout_s=5)
    assert isinstance(remote, OpenAIChat)
    assert (remote.model, remote.base_url, remote.timeout_s) == (
        "llama3",
        "http://127.0.0.1:1/v1",
        5,
    )


@pytest.mark.parametrize("spec", ["gpt-4o", "openai:", "gemini:pro", "simulated:fast"])
def test_bad_model_specs_list_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="openai:MODEL"):
        parse_model_spec(spec)


def test_simulated_spec_refuses_a_base_url() -> None:
    with pytest.raises(ValueError, match="takes no base_url"):
        parse_model_spec("simulated", base_url="http://x")


def test_completion_round_trips_through_json_dict() -> None:
    completion = Completion("t", "m", 1, 2, "stop")
    assert Completion.from_dict(completion.to_dict()) == completion
    assert completion.total_tokens == 3
    with pytest.raises(ValueError):
        Completion.from_dict({"text": 1, "model": "m"})


def test_importing_models_installs_the_usage_hook_workers_count_calls_with() -> None:
    # A worker imports asyncgraph.models (through the text layer) and nothing else of it:
    # the hook that sends a remote task's model usage back must come with the import.
    import asyncgraph.models  # noqa: F401
    from asyncgraph.taskhooks import task_hooks

    assert "models" in task_hooks()
