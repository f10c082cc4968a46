"""OpenAIChat against a real local HTTP server speaking the chat completions protocol."""

from __future__ import annotations

import email.utils
import json
import logging
from datetime import UTC, datetime, timedelta

import anyio
import httpx
import pytest

from asyncgraph.distributed._redis_server import free_port
from asyncgraph.models import (
    LocalRateLimiter,
    ModelConnectionError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelResponseError,
    ModelRetryError,
    ModelServerError,
    ModelTimeoutError,
    OpenAIChat,
    RateLimit,
    Retry,
)
from asyncgraph.models._testing import OpenAITestServer, Reply

pytestmark = pytest.mark.anyio

HELLO = [{"role": "user", "content": "hello there"}]


def model_for(server: OpenAITestServer, **options: object) -> OpenAIChat:
    return OpenAIChat("test-model", base_url=server.url, api_key="sk-test", **options)  # type: ignore[arg-type]


async def test_completion_returns_text_usage_and_model(server: OpenAITestServer) -> None:
    async with model_for(server, default_params={"temperature": 0}) as model:
        answer = await model.complete(
            [{"role": "system", "content": "be brief"}, *HELLO], max_tokens=5
        )
    assert answer.text == "echo: hello there"
    assert (answer.prompt_tokens, answer.completion_tokens) == (4, 3)
    assert answer.model == "test-model"
    assert answer.finish_reason == "stop" and not answer.cached
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.body == {
        "model": "test-model",
        "messages": [{"role": "system", "content": "be brief"}, *HELLO],
        "temperature": 0,
        "max_tokens": 5,
    }


async def test_429_waits_for_retry_after_then_succeeds(server: OpenAITestServer) -> None:
    server.script(Reply(status=429, headers={"Retry-After": "1"}))
    async with model_for(server, retry=Retry(backoff_base_s=0.001)) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    first, second = server.requests
    assert (first.status, second.status) == (429, 200)
    # The backoff alone would be ~1 ms; the second attempt waited for Retry-After.
    assert second.arrived_s - first.arrived_s >= 0.99
    assert model.usage.snapshot().retries == 1


async def test_retry_after_is_capped_by_retry_after_max_s(server: OpenAITestServer) -> None:
    server.script(Reply(status=429, headers={"Retry-After": "3600"}))
    retry = Retry(retry_after_max_s=0.01)
    async with model_for(server, retry=retry) as model:
        with anyio.fail_after(10):
            answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    assert server.statuses() == [429, 200]


async def test_500_then_success_is_retried(server: OpenAITestServer, fast_retry: Retry) -> None:
    server.script(Reply(status=500), Reply(status=503))
    async with model_for(server, retry=fast_retry) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    assert server.statuses() == [500, 503, 200]
    usage = model.usage.snapshot()
    assert (usage.requests, usage.retries, usage.errors) == (1, 2, 0)


async def test_400_raises_request_error_with_status_and_server_message(
    server: OpenAITestServer, fast_retry: Retry
) -> None:
    server.script(Reply(status=400, error="Invalid value for 'temperature': must be <= 2"))
    async with model_for(server, retry=fast_retry) as model:
        with pytest.raises(ModelRequestError) as info:
            await model.complete(HELLO, temperature=7)
    err = info.value
    assert err.status_code == 400
    assert err.server_message == "Invalid value for 'temperature': must be <= 2"
    assert "HTTP 400" in str(err) and "must be <= 2" in str(err) and "test-model" in str(err)
    assert server.statuses() == [400]  # not retried
    assert model.usage.snapshot().errors == 1


async def test_404_error_hints_at_model_name(server: OpenAITestServer) -> None:
    server.script(Reply(status=404, error="The model `nope` does not exist"))
    async with model_for(server) as model:
        with pytest.raises(ModelRequestError, match="check the model name") as info:
            await model.complete(HELLO)
    assert info.value.status_code == 404


async def test_persistent_5xx_ends_in_retry_error_chaining_the_last(
    server: OpenAITestServer, fast_retry: Retry
) -> None:
    server.script(*[Reply(status=502, error="bad gateway")] * 3)
    async with model_for(server, retry=fast_retry) as model:
        with pytest.raises(ModelRetryError, match="gave up after 3 attempts") as info:
            await model.complete(HELLO)
    assert info.value.attempts == 3
    assert isinstance(info.value.__cause__, ModelServerError)
    assert info.value.last_error.status_code == 502  # type: ignore[attr-defined]
    assert server.statuses() == [502, 502, 502]


async def test_single_attempt_raises_the_error_itself(server: OpenAITestServer) -> None:
    server.script(Reply(status=429, error="slow down"))
    async with model_for(server, retry=Retry(max_attempts=1)) as model:
        with pytest.raises(ModelRateLimitedError, match="slow down"):
            await model.complete(HELLO)


async def test_connection_refused_is_retried_then_clear_error(fast_retry: Retry) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    async with OpenAIChat("m", base_url=url, api_key="k", retry=fast_retry) as model:
        with pytest.raises(ModelRetryError) as info:
            await model.complete(HELLO)
    assert info.value.attempts == 3
    assert isinstance(info.value.last_error, ModelConnectionError)
    assert url in str(info.value)
    assert model.usage.snapshot().retries == 2


async def test_dropped_connection_is_retried(server: OpenAITestServer, fast_retry: Retry) -> None:
    server.script(Reply(drop=True))
    async with model_for(server, retry=fast_retry) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    assert server.statuses() == [0, 200]


async def test_timeout_deadline_raises_timeout_error(server: OpenAITestServer) -> None:
    server.script(Reply(delay_s=30))  # answered after 30 s, without the deadline
    async with model_for(server, timeout_s=0.2, retry=Retry(max_attempts=1)) as model:
        with pytest.raises(ModelTimeoutError, match=r"timeout_s=0\.2"):
            await model.complete(HELLO)


async def test_timeouts_are_retried(server: OpenAITestServer, fast_retry: Retry) -> None:
    server.script(Reply(delay_s=30))
    async with model_for(server, timeout_s=0.2, retry=fast_retry) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    assert model.usage.snapshot().retries == 1


async def test_malformed_body_raises_response_error(server: OpenAITestServer) -> None:
    server.script(Reply(body=b'{"choices": []}'))
    async with model_for(server) as model:
        with pytest.raises(ModelResponseError, match="not a chat completion"):
            await model.complete(HELLO)
    assert server.statuses() == [200]


async def test_model_is_reusable_after_aclose(server: OpenAITestServer) -> None:
    model = model_for(server)
    await model.complete(HELLO)
    await model.aclose()
    await model.complete(HELLO)  # opens new connections
    await model.aclose()
    assert server.statuses() == [200, 200]


async def test_cancelled_call_propagates_cancellation(server: OpenAITestServer) -> None:
    server.script(Reply(delay_s=30))
    async with model_for(server) as model:
        with anyio.move_on_after(0.1) as scope:
            await model.complete(HELLO)
    assert scope.cancelled_caught
    assert model.usage.snapshot().errors == 0


def test_api_key_comes_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    model = OpenAIChat("gpt-4o-mini")
    assert model.base_url == "https://api.openai.com/v1"
    assert model._headers["authorization"] == "Bearer sk-env"


def test_missing_api_key_for_openai_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        OpenAIChat("gpt-4o-mini")


async def test_reserved_params_are_rejected(server: OpenAITestServer) -> None:
    async with model_for(server) as model:
        with pytest.raises(ValueError, match="stream"):
            await model.complete(HELLO, stream=True)
        with pytest.raises(TypeError, match=r"messages\[0\]"):
            await model.complete(["hello"])  # type: ignore[list-item]
    assert server.requests == []


async def test_408_is_retried_and_409_is_not(server: OpenAITestServer, fast_retry: Retry) -> None:
    server.script(Reply(status=408, error="request timeout"))
    async with model_for(server, retry=fast_retry) as model:
        assert (await model.complete(HELLO)).text == "echo: hello there"
        assert server.statuses() == [408, 200]
        server.script(Reply(status=409, error="conflict"))
        with pytest.raises(ModelRequestError) as info:
            await model.complete(HELLO)
    assert info.value.status_code == 409
    assert server.statuses() == [408, 200, 409]


async def test_retry_after_as_an_http_date_is_honoured(server: OpenAITestServer) -> None:
    in_an_hour = email.utils.format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    server.script(Reply(status=429, headers={"Retry-After": in_an_hour}))
    # The backoff alone would wait ~1 ms; the date asks for an hour, capped at 0.2 s.
    retry = Retry(backoff_base_s=0.001, retry_after_max_s=0.2, retry_after_jitter=0)
    async with model_for(server, retry=retry) as model:
        with anyio.fail_after(10):
            await model.complete(HELLO)
    first, second = server.requests
    assert (first.status, second.status) == (429, 200)
    assert second.arrived_s - first.arrived_s >= 0.19


async def test_retry_after_ms_is_honoured(server: OpenAITestServer) -> None:
    server.script(Reply(status=429, headers={"retry-after-ms": "150"}))
    retry = Retry(backoff_base_s=0.001, retry_after_jitter=0)
    async with model_for(server, retry=retry) as model:
        await model.complete(HELLO)
    first, second = server.requests
    assert second.arrived_s - first.arrived_s >= 0.14


def test_one_model_serves_consecutive_event_loops(server: OpenAITestServer) -> None:
    """A model kept per process (resolve_model) outlives anyio.run calls and backends."""
    model = model_for(server, retry=Retry(max_attempts=1))

    async def use() -> str:
        return (await model.complete(HELLO)).text

    assert anyio.run(use, backend="asyncio") == "echo: hello there"
    assert anyio.run(use, backend="trio") == "echo: hello there"
    assert anyio.run(use, backend="asyncio") == "echo: hello there"
    assert server.statuses() == [200, 200, 200]
    # Each loop closed its own connections when it ended: nothing is left to reuse.
    assert len(model._clients) == 0


async def test_unexpected_transport_error_becomes_a_connection_error(
    server: OpenAITestServer, fast_retry: Retry, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("Event loop is closed")

    model = model_for(server, retry=fast_retry)
    built: list[httpx.AsyncClient] = []

    def new_client() -> httpx.AsyncClient:
        client = httpx.AsyncClient(transport=httpx.MockTransport(broken))
        built.append(client)
        return client

    monkeypatch.setattr(model, "_new_client", new_client)
    async with model:
        with pytest.raises(ModelRetryError) as info:
            await model.complete(HELLO)
    assert isinstance(info.value.last_error, ModelConnectionError)
    assert "RuntimeError: Event loop is closed" in str(info.value)
    assert len(built) == 3  # every retry started from a new connection pool
    assert all(client.is_closed for client in built)


NO_USAGE = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "test-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    }
).encode()


class FixedClock:
    def __call__(self) -> float:
        return 1000.0


async def test_missing_usage_keeps_the_token_estimate_booked(server: OpenAITestServer) -> None:
    limit = RateLimit(tokens_per_minute=600, margin_s=0)  # one token per 0.1 s
    silent = LocalRateLimiter(limit, clock=FixedClock())
    server.script(Reply(body=NO_USAGE))
    async with model_for(server, rate_limit=silent) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "hi" and answer.total_tokens == 0
    estimate = model.estimate_tokens(HELLO, {})
    assert silent.reserve() == pytest.approx(estimate * 0.1)  # the booking stands

    reported = LocalRateLimiter(limit, clock=FixedClock())
    async with model_for(server, rate_limit=reported) as model:
        answer = await model.complete(HELLO)
    assert 0 < answer.total_tokens < estimate
    assert reported.reserve() == pytest.approx(answer.total_tokens * 0.1)  # corrected


KEY = "sk-echoed-key-0123456789"


def credential_url(server: OpenAITestServer) -> str:
    """The server's base URL with a password in the userinfo and a key in the query."""
    return server.url.replace("http://", "http://azure-user:url-pass-4567@") + (
        "?api-version=2024-10-21&api-key=query-key-8910"
    )


async def test_a_base_url_with_a_query_keeps_it_after_the_path(server: OpenAITestServer) -> None:
    async with OpenAIChat("test-model", base_url=credential_url(server), api_key=KEY) as model:
        answer = await model.complete(HELLO)
    assert answer.text == "echo: hello there"
    [request] = server.requests
    assert request.path == "/v1/chat/completions?api-version=2024-10-21&api-key=query-key-8910"


async def test_errors_replies_and_repr_never_show_the_key_nor_the_url_credentials(
    server: OpenAITestServer,
) -> None:
    secrets = (KEY, "url-pass-4567", "query-key-8910")
    server.script(
        Reply(status=401, error=f"invalid api key {KEY} for {credential_url(server)}"),
        Reply(text=f"your key is {KEY} and the url password is url-pass-4567"),
        Reply(body=f"not json, key {KEY}".encode()),
    )
    model = OpenAIChat("test-model", base_url=credential_url(server), api_key=KEY)
    async with model:
        with pytest.raises(ModelRequestError) as rejected:
            await model.complete(HELLO)
        answer = await model.complete(HELLO)
        with pytest.raises(ModelResponseError) as unreadable:
            await model.complete(HELLO)
    shown = [
        str(rejected.value),
        rejected.value.server_message,
        answer.text,
        str(unreadable.value),
        repr(model),
        model.cache_endpoint,
        json.dumps(model.cache_request(HELLO, {})),
    ]
    for text in shown:
        for secret in secrets:
            assert secret not in text, (secret, text)
    assert "invalid api key [redacted]" in rejected.value.server_message
    assert answer.text == "your key is [redacted] and the url password is [redacted]"
    assert "azure-user:***@" in repr(model) and "api-key=***" in str(rejected.value)


async def test_a_connection_error_does_not_show_the_url_credentials() -> None:
    url = f"http://u:url-pass-4567@127.0.0.1:{free_port()}/v1?api-key=query-key-8910"
    model = OpenAIChat("test-model", base_url=url, retry=Retry(max_attempts=1))
    async with model:
        with pytest.raises(ModelConnectionError) as failed:
            await model.complete(HELLO)
    assert "url-pass-4567" not in str(failed.value) and "query-key-8910" not in str(failed.value)
    assert "u:***@127.0.0.1" in str(failed.value)


async def test_httpx_request_log_lines_show_the_url_redacted(
    server: OpenAITestServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="httpx")
    async with OpenAIChat("test-model", base_url=credential_url(server), api_key=KEY) as model:
        await model.complete(HELLO)
    assert "azure-user:***@" in caplog.text and "api-key=***" in caplog.text
    assert "url-pass-4567" not in caplog.text and "query-key-8910" not in caplog.text
