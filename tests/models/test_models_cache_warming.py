"""A step's cache warmed before it fans out (#34, NOTE [Cache warming]), on local fakes
whose cached prefix becomes readable only once the request that wrote it was worked on
(Anthropic: its answer begins; OpenAI: its answer returns)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncgraph.models import AnthropicChat, AzureOpenAIChat, OpenAIChat, Retry, track_usage
from asyncgraph.models._testing import Reply
from asyncgraph.models._testing_local import TimedAnthropicTestServer, TimedOpenAITestServer

pytestmark = pytest.mark.anyio

PREFIX = " ".join(f"Rule {i}: answer with care." for i in range(400))  # 2,000 words


async def _fan_out(model: Any, n: int = 16, prefix: str = PREFIX) -> list[Any]:
    results: list[Any] = [None] * n

    async def one(i: int) -> None:
        messages = [
            {"role": "system", "content": prefix},
            {"role": "user", "content": f"Question {i}: what is {i} * 7?"},
        ]
        try:
            results[i] = await model.complete(messages)
        except Exception as exc:  # noted, the others go on
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return results


def _claude(server: TimedAnthropicTestServer, **options: Any) -> AnthropicChat:
    """A model of ``server`` that marks its prompts for Anthropic's cache."""
    return AnthropicChat(
        "claude-sonnet-4-20250514",
        base_url=server.url,
        api_key="anthropic-test-key",
        cache_prompt=True,
        **options,
    )


async def test_anthropic_requests_wait_until_the_first_answer_begins_then_read_the_cache() -> None:
    """The first request is streamed; the others leave at its ``message_start`` (the
    moment Anthropic makes the prefix readable), not when its whole answer is back."""
    latency, begins = 3.0, 0.05  # a long answer: being released at its start shows
    with TimedAnthropicTestServer(latency_s=latency, ready_s=begins) as server:
        async with _claude(server) as model:
            with track_usage() as usage:
                results = await _fan_out(model)
        requests = sorted(server.requests, key=lambda r: r.arrived_s)
    first, others = requests[0], requests[1:]
    assert first.body["stream"] is True and not any("stream" in r.body for r in others)
    assert all(first.arrived_s + begins <= r.arrived_s < first.arrived_s + latency for r in others)
    assert [r.text for r in results] == [f"echo: Question {i}: what is {i} * 7?" for i in range(16)]
    total = usage.snapshot()
    assert total.cache_read_tokens / total.prompt_tokens >= 0.85
    assert total.cache_write_tokens == 2000  # written once, not by every request
    # The streamed answer's usage is the one the server billed.
    assert total.prompt_tokens == sum(b.prompt_tokens for b in server.bill)
    assert total.completion_tokens == sum(b.completion_tokens for b in server.bill)


async def test_openai_requests_wait_for_the_first_answer_then_read_the_cache() -> None:
    latency = 0.2
    with TimedOpenAITestServer(latency_s=latency) as server:
        async with OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="test") as model:
            model.warm_cache = True  # a local server is not warmed unless asked
            with track_usage() as usage:
                await _fan_out(model)
        arrivals = sorted(r.arrived_s for r in server.requests)
    assert all(t >= arrivals[0] + latency for t in arrivals[1:])
    total = usage.snapshot()
    assert total.cache_read_tokens / total.prompt_tokens >= 0.85


async def test_warming_turned_off_sends_every_request_at_once() -> None:
    """``warm_cache = False``: a step's requests leave together (none waits for the first
    answer), as before warming; the cost is the cache the late ones miss."""
    latency = 3.0  # warming would hold the others this long; a busy machine sends sooner
    with TimedAnthropicTestServer(latency_s=latency, ready_s=0.05) as server:
        async with _claude(server) as model:
            model.warm_cache = False
            await _fan_out(model, n=4)
        arrivals = sorted(r.arrived_s for r in server.requests)
    # All four arrived before the first answer was back: nothing held them.
    assert len(arrivals) == 4 and arrivals[-1] < arrivals[0] + latency


async def test_a_first_answer_cut_after_it_began_keeps_the_prefix_warm() -> None:
    """An ``overloaded_error`` in the first request's stream, after ``message_start``:
    the others were released when it began (before its retry went, a backoff of at least
    2 s later) and read the prefix it wrote; the first is retried and answers too."""
    with TimedAnthropicTestServer(latency_s=0.2, ready_s=0.05) as server:
        server.script(Reply(error="Overloaded"))
        retry = Retry(max_attempts=2, backoff_base_s=4.0)  # the retry 2 to 4 s later
        async with _claude(server, retry=retry) as model:
            results = await _fan_out(model, n=6)
        requests = sorted(server.requests, key=lambda r: r.arrived_s)
        bills = server.bill
    assert not [r for r in results if isinstance(r, Exception)]
    (first, again), others = (
        [r for r in requests if r.body.get("stream")],
        [r for r in requests if not r.body.get("stream")],
    )
    assert len(others) == 5
    assert all(first.arrived_s < r.arrived_s < again.arrived_s for r in others)
    # Six answers billed (the cut one is not), each reading the 2,000-word prefix.
    assert [b.cache_read_tokens for b in bills] == [2000] * 6


async def test_a_failed_first_request_releases_the_others() -> None:
    with TimedAnthropicTestServer(latency_s=0.05) as server:
        server.script(Reply(status=400, error="bad request"))
        async with _claude(server) as model:
            results = await _fan_out(model, n=6)
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 1 and server.statuses().count(200) == 5


def test_only_a_cacheable_prefix_is_warmed() -> None:
    claude = AnthropicChat("claude-sonnet-4-20250514", api_key="k", cache_prompt=True)
    long = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "Hi"}]
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert claude._cache_prefix(long, {}) is not None
    assert claude._cache_prefix(short, {}) is None  # under Anthropic's 1,024 tokens
    unmarked = AnthropicChat("claude-sonnet-4-20250514", api_key="k")
    assert unmarked._cache_prefix(long, {}) is None  # nothing marked: nothing cached
    hosted = OpenAIChat("gpt-4o-mini", api_key="sk-test")
    assert hosted._cache_prefix(long, {}) is not None  # OpenAI's own API caches by itself
    assert hosted._cache_prefix(short, {}) is None
    local = OpenAIChat("m", base_url="http://127.0.0.1:1/v1")
    assert local._cache_prefix(long, {}) is None  # another server: only when asked
    azure = AzureOpenAIChat("d", "https://example.openai.azure.com", "k")
    assert azure._cache_prefix(long, {}) is not None  # Azure caches as OpenAI does
    assert azure._cache_prefix(short, {}) is None


def test_a_haiku_model_warms_only_a_prefix_of_2048_tokens() -> None:
    """Anthropic's minimum cacheable prompt is 1,024 tokens, 2,048 for Haiku models: a
    prefix of about 1,500 tokens is warmed on Sonnet, not on Haiku."""
    middle = [
        {"role": "system", "content": "x" * 6000},  # about 1,500 tokens at 4 a character
        {"role": "user", "content": "Hi"},
    ]
    sonnet = AnthropicChat("claude-sonnet-4-20250514", api_key="k", cache_prompt=True)
    haiku = AnthropicChat("claude-3-5-haiku-20241022", api_key="k", cache_prompt=True)
    assert sonnet._cache_prefix(middle, {}) is not None
    assert haiku._cache_prefix(middle, {}) is None
    longer = [{"role": "system", "content": "x" * 10_000}, {"role": "user", "content": "Hi"}]
    assert haiku._cache_prefix(longer, {}) is not None
