"""AnthropicChat against a strict local fake of Anthropic's Messages API (no network)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.models import (
    AnthropicChat,
    LocalRateLimiter,
    MemoryCache,
    ModelConfigError,
    ModelConnectionError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelResponseError,
    ModelRetryError,
    ModelServerError,
    ModelTimeoutError,
    Pricing,
    RateLimit,
    Retry,
)
from asyncgraph.models._anthropic import StreamedMessage, messages_completion, messages_request
from asyncgraph.models._http import EventStream
from asyncgraph.models._testing import Reply
from asyncgraph.models._testing_providers import AnthropicTestServer
from asyncgraph.text import image, llm_call

pytestmark = pytest.mark.anyio

KEY = "anthropic-test-key"
HELLO = [{"role": "user", "content": "hello there"}]
PNG = base64.b64encode(b"\x89PNG fake bytes").decode()


@pytest.fixture
def claude() -> Iterator[AnthropicTestServer]:
    with AnthropicTestServer(api_key=KEY) as srv:
        yield srv


def model_for(server: AnthropicTestServer, **options: object) -> AnthropicChat:
    return AnthropicChat("claude-test", base_url=server.url, api_key=KEY, **options)  # type: ignore[arg-type]


async def test_a_call_sends_the_documented_request_and_reads_the_answer(
    claude: AnthropicTestServer,
) -> None:
    async with model_for(claude, max_tokens=300) as model:
        answer = await model.complete(
            [{"role": "system", "content": "be brief"}, *HELLO], temperature=0, stop="END"
        )
    assert (answer.text, answer.model, answer.finish_reason) == (
        "echo: hello there",
        "claude-test",
        "stop",
    )
    assert (answer.prompt_tokens, answer.completion_tokens) == (4, 3)
    [request] = claude.requests
    assert request.path == "/v1/messages" and request.status == 200
    assert request.headers["x-api-key"] == KEY
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert request.headers["content-type"] == "application/json"
    assert "authorization" not in request.headers
    assert request.body == {
        "model": "claude-test",
        "max_tokens": 300,
        "system": "be brief",
        "messages": HELLO,
        "temperature": 0,
        "stop_sequences": ["END"],
    }


async def test_images_and_a_conversation_become_anthropic_blocks(
    claude: AnthropicTestServer,
) -> None:
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "noted"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is on these?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ],
        },
    ]
    async with model_for(claude) as model:
        answer = await model.complete(messages, max_tokens=20)
    assert answer.text == "echo: what is on these?"
    sent = claude.requests[0].body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[2]["content"][1:] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
    ]


async def test_an_image_variable_of_the_text_layer_reaches_claude_as_an_image_block(
    claude: AnthropicTestServer,
) -> None:
    prompt = Parameter("Read the meter.", role="instructions")
    photo = Variable(image(b"\x89PNG meter", mime_type="image/png"), role="photo of the meter")
    async with model_for(claude) as model:
        answer = await llm_call(prompt, Variable("What does it show?"), photo, model=model)
    assert answer.data.startswith("echo: ")
    [request] = claude.requests
    assert request.status == 200 and request.body["system"] == "Read the meter."
    [user] = request.body["messages"]
    assert user["content"][-1] == {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(b"\x89PNG meter").decode(),
        },
    }


async def test_the_fake_is_strict_an_unknown_field_is_a_400_invalid_request_error(
    claude: AnthropicTestServer,
) -> None:
    async with model_for(claude) as model:
        with pytest.raises(ModelRequestError) as rejected:
            await model.complete(HELLO, frequency_of_cats=1)
    assert rejected.value.status_code == 400
    assert rejected.value.server_message == (
        "invalid_request_error: frequency_of_cats: Extra inputs are not permitted"
    )
    assert claude.statuses() == [400]


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
    ],
)
async def test_client_errors_are_not_retried_and_name_anthropics_error_type(
    claude: AnthropicTestServer, fast_retry: Retry, status: int, kind: str
) -> None:
    claude.script(Reply(status=status, error="nope"))
    async with model_for(claude, retry=fast_retry) as model:
        with pytest.raises(ModelRequestError) as rejected:
            await model.complete(HELLO)
    assert rejected.value.status_code == status
    assert rejected.value.server_message == f"{kind}: nope"
    assert len(claude.requests) == 1


async def test_529_overloaded_and_429_with_retry_after_are_retried(
    claude: AnthropicTestServer,
) -> None:
    claude.script(
        Reply(status=529, error="Overloaded"),
        Reply(status=429, error="slow down", headers={"retry-after": "0"}),
    )
    retry = Retry(max_attempts=3, backoff_base_s=0.005, backoff_max_s=0.01)
    async with model_for(claude, retry=retry) as model:
        answer = await model.complete(HELLO)
        assert answer.text == "echo: hello there"
        assert model.usage.snapshot().retries == 2
    assert claude.statuses() == [529, 429, 200]

    claude.script(*[Reply(status=529, error="Overloaded")] * 3)
    async with model_for(claude, retry=retry) as model:
        with pytest.raises(ModelRetryError) as gave_up:
            await model.complete(HELLO)
    last = gave_up.value.last_error
    assert isinstance(last, ModelServerError) and last.status_code == 529
    assert last.server_message == "overloaded_error: Overloaded"


async def test_a_429_reports_retry_after_seconds(claude: AnthropicTestServer) -> None:
    claude.script(Reply(status=429, error="slow down", headers={"retry-after": "7"}))
    async with model_for(claude, retry=Retry(max_attempts=1)) as model:
        with pytest.raises(ModelRateLimitedError) as limited:
            await model.complete(HELLO)
    assert limited.value.retry_after_s == 7
    assert limited.value.server_message == "rate_limit_error: slow down"


async def test_a_slow_answer_times_out(claude: AnthropicTestServer) -> None:
    claude.script(Reply(delay_s=2.0))
    async with model_for(claude, timeout_s=0.2, retry=Retry(max_attempts=1)) as model:
        with pytest.raises(ModelTimeoutError, match=r"timeout_s=0\.2"):
            await model.complete(HELLO)


async def test_cache_and_rate_limit_work_as_for_every_model(claude: AnthropicTestServer) -> None:
    # A stopped clock: the booking does not drain while the test reads it.
    limiter = LocalRateLimiter(RateLimit(tokens_per_minute=600_000, margin_s=0), clock=lambda: 1e3)
    async with model_for(claude, cache=MemoryCache(), rate_limit=limiter) as model:
        first = await model.complete(HELLO, max_tokens=10)
        second = await model.complete(HELLO, max_tokens=10)
        assert not first.cached and second.cached and second.text == first.text
        assert model.usage.snapshot().cache_hits == 1
    assert len(claude.requests) == 1
    # The booking was settled with the reported usage, not left at the estimate.
    assert limiter.reserve() == pytest.approx(first.total_tokens / 10_000)


async def test_prompt_caching_counts_writes_and_reads_apart_and_prices_them(
    claude: AnthropicTestServer,
) -> None:
    rules = "rule " * 200  # 200 words: 200 "tokens" in the fake
    messages = [{"role": "system", "content": rules}, *HELLO]
    pricing = Pricing(3.00, 15.00, cached_input_usd_per_1m=0.30, cache_write_usd_per_1m=3.75)
    async with model_for(claude, cache_prompt=True, pricing=pricing) as model:
        first = await model.complete(messages)
        second = await model.complete(messages)
        usage = model.usage.snapshot()
    assert claude.requests[0].body["system"] == [
        {"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}}
    ]
    assert (first.cache_write_tokens, first.cache_read_tokens) == (200, 0)
    assert (second.cache_write_tokens, second.cache_read_tokens) == (0, 200)
    assert first.prompt_tokens == second.prompt_tokens == 202  # cached tokens included
    assert (usage.cache_write_tokens, usage.cache_read_tokens) == (200, 200)
    # By hand: 2 uncached + 200 written at $3.75, then 2 uncached + 200 read at $0.30.
    expected = (2 * 3.00 + 200 * 3.75 + 3 * 15.00) + (2 * 3.00 + 200 * 0.30 + 3 * 15.00)
    assert usage.cost_usd == pytest.approx(expected / 1e6)


@dataclass
class Verdict:
    score: int
    label: str


async def test_structured_outputs_go_through_a_forced_tool(claude: AnthropicTestServer) -> None:
    claude.script(Reply(text=json.dumps({"score": 7, "label": "pass"})))
    async with model_for(claude) as model:
        verdict = await llm_call("Judge.", "an answer", model=model, response_format=Verdict)
    assert verdict.data == {"score": 7, "label": "pass"}
    body = claude.requests[0].body
    assert body["tool_choice"] == {"type": "tool", "name": "Verdict"}
    [tool] = body["tools"]
    assert tool["name"] == "Verdict" and tool["input_schema"]["type"] == "object"
    assert "response_format" not in body


def test_a_schema_that_is_not_an_object_travels_wrapped_and_comes_back_unwrapped() -> None:
    schema = {"type": "array", "items": {"type": "string"}}
    response_format = {"type": "json_schema", "json_schema": {"name": "tags", "schema": schema}}
    body = messages_request("m", HELLO, {"response_format": response_format})
    assert body["tools"][0]["input_schema"] == {
        "type": "object",
        "properties": {"value": schema},
        "required": ["value"],
    }
    answer = {
        "type": "message",
        "content": [{"type": "tool_use", "id": "t", "name": "tags", "input": {"value": ["a"]}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    completion = messages_completion(answer, "m", response_format)
    assert (completion.text, completion.finish_reason) == ('["a"]', "stop")


def test_what_anthropic_cannot_take_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match=r"params \['n', 'seed'\] have no counterpart"):
        messages_request("m", HELLO, {"seed": 1, "n": 2})
    with pytest.raises(ValueError, match="role 'tool' cannot be sent"):
        messages_request("m", [*HELLO, {"role": "tool", "content": "x"}], {})
    with pytest.raises(ValueError, match="no Anthropic counterpart"):
        messages_request("m", HELLO, {"response_format": {"type": "json_object"}})
    with pytest.raises(ValueError, match="at least one user message"):
        messages_request("m", [{"role": "system", "content": "s"}], {})
    with pytest.raises(ValueError, match=r"data:image/\.\.\.;base64"):
        messages_request(
            "m",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
            {},
        )


def test_the_default_url_needs_a_key_and_a_v1_base_url_is_taken_as_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    with pytest.raises(ModelConfigError, match="ANTHROPIC_API_KEY is not set"):
        AnthropicChat("claude-sonnet-4-20250514")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-env-key-123456")
    model = AnthropicChat("claude-sonnet-4-20250514")
    assert model.url == "https://api.anthropic.com/v1/messages"
    assert model._headers["x-api-key"] == "sk-ant-env-key-123456"
    assert AnthropicChat("m", base_url="http://gw:8080/v1").url == "http://gw:8080/v1/messages"


async def test_the_key_is_never_logged_shown_or_cached(
    claude: AnthropicTestServer, caplog: pytest.LogCaptureFixture
) -> None:
    claude.script(
        Reply(status=529, error="Overloaded"),
        Reply(text=f"your key is {KEY}"),
        Reply(status=401, error=f"invalid x-api-key {KEY}"),
    )
    retry = Retry(max_attempts=2, backoff_base_s=0.005, backoff_max_s=0.01)
    with caplog.at_level(logging.DEBUG):
        async with model_for(claude, retry=retry, cache=MemoryCache()) as model:
            answer = await model.complete(HELLO)
            with pytest.raises(ModelRequestError) as rejected:
                await model.complete(HELLO, cache=False)
    shown = [
        caplog.text,
        answer.text,
        str(rejected.value),
        rejected.value.server_message,
        repr(model),
        json.dumps(model.cache_request(HELLO, {})),
    ]
    assert "retrying" in caplog.text  # the 529 was logged
    for text in shown:
        assert KEY not in text, text


# -- the streamed request that warms a step's cache (NOTE [Cache warming]) --------------

RULES = " ".join(f"Rule {i}: answer with care." for i in range(300))  # 1,500 words


def _warmed(server: AnthropicTestServer, **options: object) -> AnthropicChat:
    return model_for(server, cache_prompt=True, retry=Retry(max_attempts=1), **options)


@pytest.mark.parametrize("structured", [False, True])
async def test_the_streamed_first_request_reads_as_the_same_answer(structured: bool) -> None:
    """The request that warms a prefix is streamed; its ``Completion`` (text, tool input,
    stop reason, usage with cache writes) is the one the one-body answer gives."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params: dict[str, object] = {"temperature": 0}
    if structured:
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "count", "schema": schema},
        }
    reply = '{"n": 7}' if structured else "seven, said in a few words"
    messages = [{"role": "system", "content": RULES}, {"role": "user", "content": "7?"}]
    answers = []
    for warm in (True, False):
        with AnthropicTestServer(api_key=KEY, min_cache_tokens=1024) as server:
            server.script(Reply(text=reply))
            async with _warmed(server) as model:
                model.warm_cache = warm
                answers.append(await model.complete(messages, **params))
            assert ("stream" in server.requests[0].body) is warm
    streamed, whole = answers
    assert streamed == whole
    assert streamed.text == reply and streamed.finish_reason == "stop"
    # The prefix (the forced tool, counted as a token by the fake, and the rules) written.
    assert streamed.cache_write_tokens == 1500 + structured
    assert streamed.completion_tokens == len(reply.split())


def _event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """One server-sent event of Anthropic's stream: its name, and its data of that type."""
    return kind, {"type": kind, **fields}


def test_a_stream_of_documented_events_is_put_together() -> None:
    """Anthropic's documented stream, with a thinking block, a ping, an event type not
    known here, and message_delta's final usage."""
    begun: list[bool] = []
    stream = StreamedMessage("claude-test", "http://x", lambda: begun.append(True))
    start = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 25, "cache_read_input_tokens": 1000, "output_tokens": 1},
    }
    events = [
        _event("message_start", message=start),
        _event("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
        _event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Let me"}),
        _event("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "sig"}),
        _event("content_block_stop", index=0),
        _event("ping"),
        _event("content_block_start", index=1, content_block={"type": "text", "text": ""}),
        _event("content_block_delta", index=1, delta={"type": "text_delta", "text": "Hello"}),
        _event("something_new", index=1),
        _event("content_block_delta", index=1, delta={"type": "text_delta", "text": ", world"}),
        _event("content_block_stop", index=1),
        _event(
            "message_delta",
            delta={"stop_reason": "max_tokens", "stop_sequence": None},
            usage={"output_tokens": 15},
        ),
    ]  # fmt: skip
    for name, data in events:
        stream(name, data)
    assert begun == [True]
    with pytest.raises(ValueError, match="before message_stop"):
        stream.message()
    stream("message_stop", {"type": "message_stop"})
    answer = messages_completion(stream.message(), "claude-test")
    assert (answer.text, answer.finish_reason) == ("Hello, world", "length")
    assert (answer.prompt_tokens, answer.cache_read_tokens, answer.completion_tokens) == (
        1025,
        1000,
        15,
    )
    assert stream.message()["content"][0] == {
        "type": "thinking",
        "thinking": "Let me",
        "signature": "sig",
    }


async def test_an_error_in_the_stream_is_the_status_error_its_type_stands_for() -> None:
    """Anthropic sends errors mid-stream (``overloaded_error``: a 529, retried; an
    ``invalid_request_error``: a 400, not retried)."""
    messages = [{"role": "system", "content": RULES}, {"role": "user", "content": "7?"}]
    with AnthropicTestServer(api_key=KEY, min_cache_tokens=1024) as server:
        server.script(
            Reply(error="Overloaded"), Reply(error="bad", error_type="invalid_request_error")
        )
        # A model each: a prefix warmed once is not warmed (nor streamed) again.
        async with _warmed(server) as model:
            with pytest.raises(ModelServerError) as overloaded:
                await model.complete(messages)
        async with _warmed(server) as model:
            with pytest.raises(ModelRequestError) as refused:
                await model.complete(messages)
        assert all(r.body["stream"] for r in server.requests)
    assert overloaded.value.status_code == 529 and overloaded.value.retryable
    assert overloaded.value.server_message == "overloaded_error: Overloaded"
    assert refused.value.status_code == 400 and not refused.value.retryable


async def test_a_stream_cut_short_is_retried_and_one_not_of_events_is_not_an_answer() -> None:
    """A stream that ends before ``message_stop`` was cut (a retried connection error); an
    event that is not JSON is not an answer (not retried); a server that answers the
    streamed request with one JSON body (a proxy that does not stream) is read as it."""
    messages = [{"role": "system", "content": RULES}, {"role": "user", "content": "7?"}]
    started = json.dumps(
        {"type": "message_start", "message": {"type": "message", "content": [], "usage": {}}}
    )
    sse = {"content-type": "text/event-stream"}
    whole = {
        "type": "message",
        "model": "claude-test",
        "content": [{"type": "text", "text": "seven"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 1, "cache_creation_input_tokens": 1500},
    }
    with AnthropicTestServer(api_key=KEY, min_cache_tokens=1024) as server:
        server.script(
            Reply(body=f"event: message_start\ndata: {started}\n\n".encode(), headers=sse),
            Reply(body=b"event: message_start\ndata: <html>\n\n", headers=sse),
            Reply(body=json.dumps(whole).encode()),
        )
        async with _warmed(server) as model:
            with pytest.raises(ModelConnectionError, match=r"cut short.*before message_stop"):
                await model.complete(messages)
        assert ModelConnectionError.retryable
        async with _warmed(server) as model:
            with pytest.raises(ModelResponseError, match=r"'message_start' event .* '<html>'"):
                await model.complete(messages)
        async with _warmed(server) as model:
            answer = await model.complete(messages)
        assert all(r.body["stream"] for r in server.requests)
    assert (answer.text, answer.finish_reason, answer.cache_write_tokens) == ("seven", "stop", 1500)


def test_server_sent_events_are_read_as_the_specification_reads_them() -> None:
    """Lines end at CRLF, LF or CR, also across chunks (not at U+2028, which JSON may hold
    raw); data lines join with LF; comments and other fields are skipped; the name is
    "message" by default; an event the stream ends in the middle of is dropped."""
    events = EventStream()
    got = events.feed(b": keep-alive\r\nevent: ping\r")
    got += events.feed(b'\ndata: {"a":\r\ndata: 1}\r\nid: 7\r\n\r')
    got += events.feed(b'\ndata: "line\xe2\x80\xa8sep"\n\n')
    got += events.feed(b"event: a\rdata: x\r\rdata: cut")
    assert got == [
        ("ping", '{"a":\n1}'),
        ("message", '"line\u2028sep"'),
        ("a", "x"),
    ]


async def test_a_slow_streamed_answer_times_out() -> None:
    messages = [{"role": "system", "content": RULES}, {"role": "user", "content": "7?"}]
    with AnthropicTestServer(api_key=KEY, min_cache_tokens=1024, begins_s=0.05) as server:
        server.script(Reply(delay_s=5.0))
        async with _warmed(server, timeout_s=0.5) as model:
            with pytest.raises(ModelTimeoutError):
                await model.complete(messages)
        assert server.requests[0].body["stream"] is True


class _BadEventThenSlow(AnthropicTestServer):
    """Streams a message_start, an event that is not JSON, then nothing for 30 s."""

    def _stream(self, req: Any, reply: Reply, body: Any, arrived: float) -> None:
        req.send_response(200)
        req.send_header("Content-Type", "text/event-stream")
        req.send_header("Transfer-Encoding", "chunked")
        req.end_headers()
        started = json.dumps(
            {"type": "message_start", "message": {"type": "message", "content": [], "usage": {}}}
        )
        for event in (f"event: message_start\ndata: {started}\n\n", "event: ping\ndata: <\n\n"):
            chunk = event.encode()
            req.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self._stopping.wait(30)


async def test_an_event_that_fails_is_the_error_even_when_the_stream_goes_on() -> None:
    """What follows a failed event is read only until just before the request's deadline:
    the call raises the event's error (not retried), not a timeout (retried)."""
    messages = [{"role": "system", "content": RULES}, {"role": "user", "content": "7?"}]
    with _BadEventThenSlow(api_key=KEY, min_cache_tokens=1024) as server:
        async with _warmed(server, timeout_s=3.0) as model:
            with pytest.raises(ModelResponseError, match="'ping' event"):
                await model.complete(messages)
