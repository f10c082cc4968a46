"""Requests a server can serve, and that fit the model: limits read from the server
(llama.cpp's /props, vLLM's /v1/models) or the dated table, reply sizes, the client's
queue, timeouts, context refusals. Real local HTTP servers (``LocalModelTestServer``)."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from asyncgraph.models import (
    AnthropicChat,
    ModelCall,
    ModelContextError,
    ModelRetryError,
    ModelTimeoutError,
    OpenAIChat,
    Retry,
    observe_calls,
    reply_tokens,
)
from asyncgraph.models._limits import TokenEstimator, context_refusal
from asyncgraph.models._testing_local import LocalModelTestServer, local_tokens

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "Say hello."}]


def _local(server: LocalModelTestServer, **options: Any) -> OpenAIChat:
    return OpenAIChat("smollm2", base_url=server.url, api_key="", **options)


async def test_limits_come_from_llama_cpp_props() -> None:
    with LocalModelTestServer(slots=3, n_ctx=1024) as server:
        async with _local(server) as model:
            limits = await model.limits()
    assert (limits.context_tokens, limits.max_concurrency, limits.source) == (1024, 3, "server")


async def test_limits_come_from_vllm_models() -> None:
    with LocalModelTestServer(flavor="vllm", n_ctx=4096) as server:
        async with _local(server) as model:
            limits = await model.limits()
    assert (limits.context_tokens, limits.max_concurrency, limits.source) == (4096, None, "server")


async def test_given_limits_win_and_the_table_knows_hosted_models() -> None:
    with LocalModelTestServer(slots=3, n_ctx=1024) as server:
        async with _local(server, context_tokens=900, max_concurrency=1) as model:
            limits = await model.limits()
    assert (limits.context_tokens, limits.max_concurrency, limits.source) == (900, 1, "given")
    hosted = OpenAIChat("gpt-4o-mini-2024-07-18", api_key="sk-test")
    assert (await hosted.limits()).context_tokens == 128_000  # no request: the table
    claude = AnthropicChat("claude-sonnet-4-20250514", api_key="test")
    assert ((await claude.limits()).context_tokens, (await claude.limits()).source) == (
        200_000,
        "table",
    )


async def test_a_server_that_says_nothing_leaves_the_limits_unknown() -> None:
    from asyncgraph.models._testing import OpenAITestServer

    with OpenAITestServer() as server:
        async with _local(server) as model:  # type: ignore[arg-type]
            await model.complete(HELLO)
            limits = await model.limits()
        assert (limits.context_tokens, limits.max_concurrency) == (None, None)
        assert "max_tokens" not in server.requests[0].body  # nothing asked, nothing sent


async def test_a_suggested_reply_size_is_sent_and_the_model_or_the_call_wins() -> None:
    with LocalModelTestServer() as server:
        async with _local(server) as model:
            with reply_tokens(100):
                await model.complete(HELLO)
                await model.complete(HELLO, max_tokens=7)
        async with _local(server, max_tokens=50) as model:
            with reply_tokens(100):
                await model.complete(HELLO)
        async with _local(server, default_params={"max_tokens": 30}) as model:
            with reply_tokens(100):
                await model.complete(HELLO)
    sent = [r.body.get("max_tokens") for r in server.requests]
    assert sent == [100, 7, 50, 30]
    assert server.completion_tokens[0] <= 100  # the small model stopped where it was told


async def test_no_size_is_suggested_where_it_would_cut_thinking_short() -> None:
    with LocalModelTestServer() as server:
        async with OpenAIChat("o4-mini", base_url=server.url, api_key="") as reasoning:
            with reply_tokens(100):
                await reasoning.complete(HELLO)  # its reasoning counts in the reply
        async with _local(server) as model:
            with reply_tokens(100):
                await model.complete(HELLO, thinking={"type": "enabled", "budget_tokens": 900})
        async with OpenAIChat("o4-mini", base_url=server.url, api_key="", max_tokens=4000) as m:
            with reply_tokens(100):
                await m.complete(HELLO)  # the model's own size goes (cut to the window)
    sizes = [r.body.get("max_tokens") for r in server.requests]
    assert sizes[:2] == [None, None] and 1900 < sizes[2] < 2048


async def test_the_reply_is_cut_to_the_room_the_window_leaves() -> None:
    with LocalModelTestServer(n_ctx=400) as server:
        async with _local(server) as model:
            messages = [{"role": "user", "content": "word " * 150}]  # about 250 tokens
            estimate = model.estimator.count(messages)  # before the answer teaches it more
            with reply_tokens(1000, whole=True):  # a whole reply: no share of the window
                await model.complete(messages)
            with reply_tokens(1000):  # an answer: at most an eighth of the window
                await model.complete([{"role": "user", "content": "Hi."}])
            first, second = server.requests
            assert first.body["max_tokens"] == 400 - estimate < 1000
            assert second.body["max_tokens"] == 64  # 400 // 8 = 50, and at least 64
        assert server.refused_for_context == 0


async def test_a_request_beyond_the_window_is_refused_before_it_is_sent() -> None:
    with LocalModelTestServer(n_ctx=256) as server:
        async with _local(server) as model:
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "word " * 400},
            ]
            with pytest.raises(ModelContextError) as info:
                await model.complete(messages)
        assert server.requests == []  # nothing sent
    error = info.value
    assert error.context_tokens == 256 and error.prompt_tokens > 256 and error.status_code is None
    assert "messages[1] (user) is the longest" in str(error)
    assert "from the server" in str(error) and "context_tokens=" in str(error)


@pytest.mark.parametrize("flavor", ["llama.cpp", "vllm"])
async def test_a_server_context_refusal_is_a_model_context_error_not_retried(flavor: str) -> None:
    with LocalModelTestServer(flavor=flavor, n_ctx=512) as server:
        # A window given too large: the server refuses, with its own error.
        async with _local(server, context_tokens=100_000, max_tokens=64) as model:
            messages = [{"role": "user", "content": "word " * 500}]
            with pytest.raises(ModelContextError) as info:
                await model.complete(messages)
            before = model.estimator.chars_per_token
        assert server.statuses() == [400]  # once: refusals are not retried
    error = info.value
    assert error.status_code == 400 and error.context_tokens == 512
    assert error.prompt_tokens is not None and error.prompt_tokens > 512
    assert "context" in str(error) and "context_tokens=" in str(error)
    assert before <= 2500 / error.prompt_tokens  # the server's count taught the estimator


async def test_a_reply_the_server_says_does_not_fit_is_asked_again_smaller() -> None:
    with LocalModelTestServer(flavor="vllm", n_ctx=1024) as server:
        # A window given too large: vLLM refuses the prompt plus the reply it asks for.
        async with _local(server, context_tokens=100_000, max_tokens=1000) as model:
            answer = await model.complete([{"role": "user", "content": "word " * 200}])
        first, second = server.requests
    assert server.statuses() == [400, 200] and answer.text
    prompt = local_tokens(first.body)
    assert first.body["max_tokens"] == 1000
    assert second.body["max_tokens"] == 1024 - prompt - 8  # what the server said was left


def test_context_refusal_reads_both_servers_bodies() -> None:
    llama = {
        "error": {
            "code": 400,
            "message": "request (2062 tokens) exceeds the available context size (2048 "
            "tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 2062,
            "n_ctx": 2048,
        }
    }
    assert context_refusal(llama, llama["error"]["message"]) == (2062, 2048)
    vllm = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 "
        "tokens (2000 in the messages, 100 in the completion). Please reduce the length."
    )
    assert context_refusal({"error": {"message": vllm}}, vllm) == (2000, 2048)
    newer = (
        "This model's maximum context length is 16384 tokens. However, you requested 8192 "
        "output tokens and your prompt contains at least 8193 input tokens"
    )
    assert context_refusal({}, newer) == (8193, 16384)
    assert context_refusal({"error": {"message": "bad key"}}, "bad key") is None


def test_the_estimator_errs_high_and_learns_the_servers_ratio() -> None:
    estimator = TokenEstimator()
    messages = [{"role": "user", "content": "x" * 3000}]
    assert estimator.count(messages) == 1000 + 8 + 16
    estimator.observe(chars=4000, messages=1, prompt_tokens=1000)  # 4 characters a token
    assert estimator.chars_per_token == pytest.approx(4.0)
    estimator.observe(chars=3500, messages=1, prompt_tokens=1000)  # the lower ratio stays
    assert estimator.chars_per_token == pytest.approx(3.5)
    estimator.observe(chars=100, messages=1, prompt_tokens=80)  # too small to say
    assert estimator.chars_per_token == pytest.approx(3.5)


async def test_max_concurrency_from_the_server_queues_on_the_client() -> None:
    with LocalModelTestServer(slots=2, s_per_token=0.002) as server:
        async with _local(server) as model:
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(model.complete, HELLO)
        assert len(server.requests) == 8
        assert server.max_busy <= 2 and server.queued == 0  # none waited in the server


async def test_a_timeout_says_where_its_time_went() -> None:
    retry = Retry(max_attempts=2, timeout_backoff_s=0.01, rng=random.Random(0))
    with LocalModelTestServer(slots=1, s_per_token=0.05) as server:  # 181 tokens: 9 s
        async with _local(server, timeout_s=0.3, retry=retry) as model:
            with pytest.raises(ModelRetryError) as info:
                await model.complete(HELLO)
    last = info.value.last_error
    assert isinstance(last, ModelTimeoutError)
    assert "in this client's queue for one of max_concurrency=1 slots" in str(last)
    assert "at the server" in str(last)


@pytest.mark.parametrize("cancels", [True, False])
async def test_a_timed_out_request_is_not_retried_behind_itself(cancels: bool) -> None:
    """A timed-out attempt's connection is closed, so a server that cancels a request
    whose client went away (llama.cpp's and vLLM's do) frees its slot: the retry, after
    its backoff, is worked on at once, never queued behind its own first attempt. A
    server that works on regardless (``cancels=False``) queues it: what the backoff is
    for, and why the timeout says where its time went."""
    # A backoff of 1 to 2 s: time enough, on a loaded machine, for the server to see the
    # first attempt's connection close.
    retry = Retry(max_attempts=2, timeout_backoff_s=2.0, rng=random.Random(0))
    calls: list[ModelCall] = []
    with LocalModelTestServer(slots=1, s_per_token=0.05, cancel_on_disconnect=cancels) as server:
        async with _local(server, timeout_s=0.5, retry=retry) as model:
            with pytest.raises(ModelRetryError), observe_calls(calls.append):
                await model.complete(HELLO)
        assert calls[0].retried_after == ("ModelTimeoutError",)  # the call log says why
        if cancels:
            assert await anyio.to_thread.run_sync(server.wait_for_cancelled, 2, 30.0)
            assert server.cancelled == 2 and server.queued == 0
        else:
            assert server.cancelled == 0 and server.queued == 1


def test_a_timeout_backs_off_longer_than_a_refusal() -> None:
    retry = Retry(backoff_base_s=0.5, rng=random.Random(0))
    refusal = max(retry.backoff_s(1) for _ in range(50))
    timeout = min(retry.backoff_s(1, timed_out=True) for _ in range(50))
    assert refusal <= 0.5 < 1.0 <= timeout  # 4x the base by default
    assert Retry(timeout_backoff_s=3.0, rng=random.Random(0)).backoff_s(1, timed_out=True) >= 1.5
    with pytest.raises(ValueError, match="must be >= 0"):
        Retry(timeout_backoff_s=-1)


def test_limits_must_be_positive_ints() -> None:
    with pytest.raises(ValueError, match=r"max_concurrency= must be an int >= 1 or None"):
        OpenAIChat("m", base_url="http://127.0.0.1:1/v1", max_concurrency=0)
    with pytest.raises(ValueError, match=r"context_tokens= must be an int >= 1 or None"):
        AnthropicChat("m", base_url="http://127.0.0.1:1", api_key="k", context_tokens=True)  # type: ignore[arg-type]
