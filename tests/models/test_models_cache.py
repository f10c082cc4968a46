"""Response caches (memory, disk, Redis) through real model calls."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
import redis

from asyncgraph.distributed._redis_server import free_port
from asyncgraph.models import (
    Completion,
    DiskCache,
    MemoryCache,
    ModelBackendError,
    OpenAIChat,
    RedisCache,
    SimulatedModel,
)
from asyncgraph.models._cache import Cache, request_key
from asyncgraph.models._testing import OpenAITestServer, Reply

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(params=["memory", "disk", pytest.param("redis", marks=pytest.mark.slow)])
async def make_cache(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[], Cache]]:
    """A factory of cache objects that share one store (as two processes would)."""
    made: list[Cache] = []
    memory = MemoryCache()

    def make() -> Cache:
        cache: Cache
        if request.param == "memory":
            cache = memory
        elif request.param == "disk":
            cache = DiskCache(tmp_path / "cache")
        else:
            cache = RedisCache(request.getfixturevalue("redis_url"), ttl_s=60)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        await cache.aclose()


def model_for(server: OpenAITestServer, cache: Cache | None) -> OpenAIChat:
    return OpenAIChat("test-model", base_url=server.url, api_key="k", cache=cache)


async def test_second_identical_call_is_a_cache_hit(
    server: OpenAITestServer, make_cache: Callable[[], Cache]
) -> None:
    async with model_for(server, make_cache()) as model:
        first = await model.complete(HELLO, temperature=0)
        second = await model.complete(HELLO, temperature=0)
    assert not first.cached and second.cached
    assert second.text == first.text and second.prompt_tokens == first.prompt_tokens
    assert len(server.requests) == 1
    usage = model.usage.snapshot()
    assert (usage.requests, usage.cache_hits) == (1, 1)
    assert usage.total_tokens == first.total_tokens  # a hit adds no tokens


async def test_cache_is_shared_by_models_on_the_same_store(
    server: OpenAITestServer, make_cache: Callable[[], Cache]
) -> None:
    async with model_for(server, make_cache()) as a, model_for(server, make_cache()) as b:
        await a.complete(HELLO)
        assert (await b.complete(HELLO)).cached
    assert len(server.requests) == 1


async def test_different_requests_miss(
    server: OpenAITestServer, make_cache: Callable[[], Cache]
) -> None:
    async with model_for(server, make_cache()) as model:
        await model.complete(HELLO, temperature=0)
        assert not (await model.complete(HELLO, temperature=1)).cached
        assert not (await model.complete([{"role": "user", "content": "bye"}])).cached
    assert len(server.requests) == 3


async def test_cache_false_bypasses_read_and_write(
    server: OpenAITestServer, make_cache: Callable[[], Cache]
) -> None:
    async with model_for(server, make_cache()) as model:
        assert not (await model.complete(HELLO, cache=False)).cached
        assert not (await model.complete(HELLO)).cached  # nothing was written
        assert (await model.complete(HELLO)).cached
        assert not (await model.complete(HELLO, cache=False)).cached  # nothing was read
    assert len(server.requests) == 3


async def test_cache_is_off_by_default(server: OpenAITestServer) -> None:
    async with model_for(server, None) as model:
        await model.complete(HELLO)
        assert not (await model.complete(HELLO)).cached
        with pytest.raises(ValueError, match="has no cache"):
            await model.complete(HELLO, cache=True)
    assert len(server.requests) == 2


async def test_disk_cache_writes_json_atomically(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path)
    key = request_key("e", "m", HELLO, {})
    await cache.set(key, Completion("hi", "m", 1, 2))
    path = cache.path_for(key)
    assert json.loads(path.read_text())["text"] == "hi"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert await cache.get(key) == Completion("hi", "m", 1, 2)


async def test_corrupt_disk_entry_is_a_miss_and_is_overwritten(
    server: OpenAITestServer, tmp_path: Path
) -> None:
    cache = DiskCache(tmp_path)
    async with model_for(server, cache) as model:
        await model.complete(HELLO)
        [entry] = await anyio.to_thread.run_sync(lambda: list(tmp_path.rglob("*.json")))
        await anyio.Path(entry).write_text("{not json")
        assert not (await model.complete(HELLO)).cached
        assert (await model.complete(HELLO)).cached
    assert len(server.requests) == 2


async def test_redis_cache_entries_expire(redis_url: str) -> None:
    cache = RedisCache(redis_url, ttl_s=30, prefix="test:cache:")
    await cache.set("abc123", Completion("hi", "m"))
    client = redis.Redis.from_url(redis_url)
    try:
        assert 0 < client.pttl("test:cache:abc123") <= 30_000
    finally:
        client.close()
    assert await cache.get("abc123") == Completion("hi", "m")
    await cache.aclose()


async def test_unreachable_redis_cache_raises_backend_error_but_calls_still_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = RedisCache(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(ModelBackendError, match="response cache"):
        await cache.get("abc")
    model = SimulatedModel(latency_s=0, cache=cache)
    with caplog.at_level(logging.WARNING, logger="asyncgraph.models"):
        answer = await model.complete(HELLO)
    assert not answer.cached
    assert "cache read failed" in caplog.text and "cache write failed" in caplog.text
    await model.aclose()


def test_request_key_is_canonical() -> None:
    a = request_key("e", "m", [{"role": "user", "content": "x"}], {"a": 1, "b": 2})
    b = request_key("e", "m", [{"content": "x", "role": "user"}], {"b": 2, "a": 1})
    assert a == b and len(a) == 64
    assert a != request_key("e", "m2", [{"role": "user", "content": "x"}], {"a": 1, "b": 2})
    assert a != request_key("e2", "m", [{"role": "user", "content": "x"}], {"a": 1, "b": 2})
    with pytest.raises(TypeError, match="cache=False"):
        request_key("e", "m", [], {"a": object()})


async def test_memory_cache_evicts_least_recently_used() -> None:
    cache = MemoryCache(max_entries=2)
    for key in ("a1", "b2", "c3"):
        await cache.set(key, Completion(key, "m"))
    assert await cache.get("a1") is None
    assert len(cache) == 2


async def test_default_params_are_part_of_the_cache_key(server: OpenAITestServer) -> None:
    cache = MemoryCache()

    def model(temperature: float) -> OpenAIChat:
        return OpenAIChat(
            "test-model",
            base_url=server.url,
            api_key="k",
            cache=cache,
            default_params={"temperature": temperature},
        )

    async with model(0.0) as cold, model(1.0) as hot, model(0.0) as cold_again:
        await cold.complete(HELLO)
        assert not (await hot.complete(HELLO)).cached  # another request was sent
        assert (await cold_again.complete(HELLO)).cached  # the same request was sent
    assert [r.body["temperature"] for r in server.requests] == [0.0, 1.0]


async def test_per_call_params_override_defaults_in_the_key(server: OpenAITestServer) -> None:
    cache = MemoryCache()
    async with (
        OpenAIChat(
            "test-model",
            base_url=server.url,
            api_key="k",
            cache=cache,
            default_params={"temperature": 1.0},
        ) as a,
        OpenAIChat("test-model", base_url=server.url, api_key="k", cache=cache) as b,
    ):
        await a.complete(HELLO, temperature=0.0)
        # Both send {"temperature": 0.0}: the same request, one answer.
        assert (await b.complete(HELLO, temperature=0.0)).cached
    assert len(server.requests) == 1


async def test_simulated_tag_replies_is_part_of_the_cache_key() -> None:
    cache = MemoryCache()

    def responder(messages: list[dict[str, object]]) -> str:
        return "42"

    tagged = SimulatedModel(latency_s=0, responder=responder, cache=cache)
    plain = SimulatedModel(latency_s=0, responder=responder, cache=cache, tag_replies=False)
    assert (await tagged.complete(HELLO)).text == "[simulated] 42"
    answer = await plain.complete(HELLO)
    assert (answer.text, answer.cached, answer.model) == ("42", False, "simulated")
    assert len(cache) == 2


async def test_cache_if_keeps_unusable_answers_out_of_the_cache(
    server: OpenAITestServer, make_cache: Callable[[], Cache]
) -> None:
    def usable(completion: Completion) -> bool:
        return completion.text == "good"

    server.script(Reply(text="bad"), Reply(text="bad"), Reply(text="good"))
    async with model_for(server, make_cache()) as model:
        first = await model.complete(HELLO, cache_if=usable)
        assert first.text == "bad" and not first.cached  # returned, but not stored
        # An unusable answer stored by a call without cache_if is deleted, not replayed.
        assert (await model.complete(HELLO)).text == "bad"
        second = await model.complete(HELLO, cache_if=usable)
        assert second.text == "good" and not second.cached
        third = await model.complete(HELLO, cache_if=usable)
        assert third.text == "good" and third.cached
    assert server.statuses() == [200, 200, 200]
