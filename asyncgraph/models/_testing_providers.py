"""Strict local fakes of Anthropic's Messages API and Azure OpenAI, for tests.

Both are ``OpenAITestServer``s (same scripting with ``Reply``, same records, same
sliding-window rate limit) that speak another documented wire format, and refuse what
the real service refuses, with its error bodies:

- ``AnthropicTestServer``: ``POST /v1/messages`` with ``x-api-key`` and
  ``anthropic-version: 2023-06-01``; the body is checked field by field (``model``,
  ``max_tokens`` required; ``system`` a string or text blocks; roles ``user`` /
  ``assistant``; text / image / tool blocks; ``cache_control`` ephemeral; no unknown
  field). Errors are ``{"type": "error", "error": {"type", "message"}}`` with
  Anthropic's types per status (529 ``overloaded_error``...). A forced tool
  (``tool_choice: {"type": "tool"}``) is answered with a ``tool_use`` block whose
  ``input`` is the reply text parsed as JSON. It keeps a prompt cache as Anthropic
  does: the prefix up to each ``cache_control`` block is written on first sight
  (``cache_creation_input_tokens``, up to the last mark, less what is read) and read
  after (``cache_read_input_tokens``, up to the longest marked prefix seen before); a
  mark whose prefix is shorter than ``min_cache_tokens`` (Anthropic's minimum is 1,024
  tokens for most models; default 0 here) caches nothing; a token is a word here.
  ``"stream": true`` is answered with Anthropic's event stream (``message_start`` with
  the usage so far once the answer begins, ``begins_s`` after the request arrived; a
  ``ping``; then, at ``Reply.delay_s`` (no sooner), each content block as
  ``content_block_start``, two deltas and ``content_block_stop``, ``message_delta``
  with the stop reason and output tokens, ``message_stop``); a 200 ``Reply`` with an
  ``error`` sends an ``error`` event after ``message_start`` instead, as Anthropic does
  mid-stream (``overloaded_error`` unless ``error_type`` says otherwise).
- ``AzureOpenAITestServer``: ``POST /openai/deployments/{name}/chat/completions
  ?api-version=V`` with ``api-key`` (or ``Authorization: Bearer`` for Entra ID);
  unknown deployments, a missing api-version and a wrong key are answered as Azure
  does; the answer names the deployment's model; ``Reply.usage`` may add
  ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from asyncgraph.models._testing import OpenAITestServer, Reply, _Handler, echo_text

__all__ = ["ANTHROPIC_ERROR_TYPES", "AnthropicTestServer", "AzureOpenAITestServer"]

MESSAGES_PATH = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_TOP_LEVEL = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "metadata",
        "tools",
        "tool_choice",
        "stream",
        "thinking",
        "service_tier",
    }
)
_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})


def _check_cache_control(block: Mapping[str, Any], where: str) -> None:
    control = block.get("cache_control")
    if control is not None and (
        not isinstance(control, dict) or control.get("type") != "ephemeral"
    ):
        raise ValueError(f"{where}.cache_control: Input should be {{'type': 'ephemeral'}}")


def _check_image(source: Any, where: str) -> None:
    if not isinstance(source, dict):
        raise ValueError(f"{where}.source: Field required")
    if source.get("type") == "base64":
        if source.get("media_type") not in _MEDIA_TYPES:
            raise ValueError(
                f"{where}.source.media_type: Input should be 'image/jpeg', 'image/png', "
                "'image/gif' or 'image/webp'"
            )
        if not isinstance(source.get("data"), str) or set(source) - {
            "type",
            "media_type",
            "data",
        }:
            raise ValueError(f"{where}.source: base64 source needs media_type and data only")
    elif source.get("type") == "url":
        if not isinstance(source.get("url"), str) or set(source) - {"type", "url"}:
            raise ValueError(f"{where}.source: url source needs url only")
    else:
        raise ValueError(f"{where}.source.type: Input should be 'base64' or 'url'")


def _check_block(block: Any, where: str, *, text_only: bool = False) -> None:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ValueError(f"{where}: Input should be a valid content block")
    kind = block["type"]
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise ValueError(f"{where}.text: Field required")
    elif text_only:
        raise ValueError(f"{where}.type: Input should be 'text'")
    elif kind == "image":
        _check_image(block.get("source"), where)
    elif kind not in ("tool_use", "tool_result", "document"):
        raise ValueError(f"{where}.type: Input tag {kind!r} found does not match any expected tag")
    _check_cache_control(block, where)


def _check_content(content: Any, where: str, *, text_only: bool = False) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}: Input should be a valid string or a non-empty list of blocks")
    for i, block in enumerate(content):
        _check_block(block, f"{where}.{i}", text_only=text_only)


def check_messages_body(body: Any) -> None:
    """Raise ``ValueError`` (answered as a 400 invalid_request_error) for a body the Messages API rejects (see the module docstring)."""
    if not isinstance(body, dict):
        raise ValueError("request body: Input should be a valid JSON object")
    extra = sorted(set(body) - _TOP_LEVEL)
    if extra:
        raise ValueError(f"{extra[0]}: Extra inputs are not permitted")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ValueError("model: Field required")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError("max_tokens: Field required (an integer >= 1)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: Field required (a non-empty list)")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise ValueError(f"messages.{i}: Input should be {{'role', 'content'}}")
        if message.get("role") not in ("user", "assistant"):
            raise ValueError(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        _check_content(message.get("content"), f"messages.{i}.content")
    if "system" in body:
        _check_content(body["system"], "system", text_only=True)
    if "stop_sequences" in body and not (
        isinstance(body["stop_sequences"], list)
        and all(isinstance(s, str) for s in body["stop_sequences"])
    ):
        raise ValueError("stop_sequences: Input should be a valid list of strings")
    _check_tools(body)


def _check_tools(body: Mapping[str, Any]) -> None:
    tools = body.get("tools", [])
    names = set()
    for i, tool in enumerate(tools if isinstance(tools, list) else [None]):
        schema = tool.get("input_schema") if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ValueError(f"tools.{i}.input_schema: Input should be an object schema")
        names.add(tool.get("name"))
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (
            "auto",
            "any",
            "tool",
            "none",
        ):
            raise ValueError("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
        if choice["type"] == "tool" and choice.get("name") not in names:
            raise ValueError(f"tool_choice.name: Tool {choice.get('name')!r} not found in tools")


def _block_words(block: Any) -> int:
    if isinstance(block, str):
        return len(block.split())
    if isinstance(block, dict) and block.get("type") == "text":
        return len(str(block.get("text", "")).split())
    return 1  # an image or a tool block: one "token" here


def _prompt_blocks(body: Mapping[str, Any]) -> list[Any]:
    """The prompt's blocks in the order the API caches them: tools, system, messages."""
    blocks: list[Any] = list(body.get("tools", []))
    system = body.get("system")
    blocks += [system] if isinstance(system, str) else list(system or [])
    for message in body.get("messages", []):
        content = message["content"]
        blocks += [content] if isinstance(content, str) else list(content)
    return blocks


def _send_events(req: _Handler, *events: tuple[str, Any]) -> None:
    """Server-sent events, one HTTP chunk each."""
    for name, data in events:
        chunk = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
        req.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))


def _halves(text: str) -> list[str]:
    return [text[: len(text) // 2], text[len(text) // 2 :]]


def _content_events(answer: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """An answer's content blocks, stop reason and output tokens, as Anthropic streams them."""
    events: list[tuple[str, Any]] = []
    for index, block in enumerate(answer["content"]):
        if block["type"] == "tool_use":
            opening = {**block, "input": {}}
            deltas = [
                {"type": "input_json_delta", "partial_json": part}
                for part in _halves(json.dumps(block["input"]))
            ]
        else:
            opening = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": part} for part in _halves(block["text"])]
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": opening},
            )
        )
        events += [
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
            for d in deltas
        ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": answer["stop_reason"], "stop_sequence": answer["stop_sequence"]}
    usage = {"output_tokens": answer["usage"]["output_tokens"]}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


class AnthropicTestServer(OpenAITestServer):
    """See the module docstring. ``url`` is the ``base_url`` to give ``AnthropicChat``;
    ``api_key`` is the key it accepts (``None``: any key, but one is required)."""

    def __init__(
        self,
        *,
        api_key: str | None = "anthropic-test-key",
        min_cache_tokens: int = 0,
        begins_s: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.api_key = api_key
        self.min_cache_tokens = min_cache_tokens
        self.begins_s = begins_s
        self._cached_prefixes: set[str] = set()
        self._cache_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _refuse(self, path: str, body: Any, headers: Mapping[str, str]) -> Reply | None:
        if path.split("?", 1)[0].rstrip("/") != MESSAGES_PATH:
            return Reply(status=404, error="Not found")
        key = headers.get("x-api-key")
        if not key or (self.api_key is not None and key != self.api_key):
            return Reply(status=401, error="invalid x-api-key")
        if headers.get("anthropic-version") != "2023-06-01":
            return Reply(status=400, error="anthropic-version: header is required (2023-06-01)")
        if not headers.get("content-type", "").startswith("application/json"):
            return Reply(status=400, error="content-type: must be application/json")
        try:
            check_messages_body(body)
        except ValueError as exc:
            return Reply(status=400, error=str(exc))
        return None

    def _prompt_cache(self, body: Mapping[str, Any]) -> tuple[int, int, int]:
        """``(uncached, written, read)`` words of the prompt (see the module docstring)."""
        blocks = _prompt_blocks(body)
        words = [_block_words(b) for b in blocks]
        ends = [
            i + 1
            for i, b in enumerate(blocks)
            if isinstance(b, dict)
            and "cache_control" in b
            and sum(words[: i + 1]) >= self.min_cache_tokens
        ]
        if not ends:
            return sum(words), 0, 0
        keys = [
            hashlib.sha256(
                json.dumps([body["model"], blocks[:end]], sort_keys=True).encode()
            ).hexdigest()
            for end in ends
        ]
        hits = self._cached_ends(ends, keys)
        read = sum(words[: max(hits)]) if hits else 0
        written = sum(words[: ends[-1]]) - read
        return sum(words[ends[-1] :]), written, read

    def _cached_ends(self, ends: list[int], keys: list[str]) -> list[int]:
        """Of the marked prefixes (ending at block ``ends``, hashed ``keys``), the ends of
        those the cache holds; all of them are written to it."""
        with self._cache_lock:
            hits = [
                end for end, key in zip(ends, keys, strict=True) if key in self._cached_prefixes
            ]
            self._cached_prefixes.update(keys)
        return hits

    def _answer(self, reply: Reply, path: str, body: Any) -> Any:
        last = body["messages"][-1]["content"]
        if not isinstance(last, str):
            last = " ".join(b["text"] for b in last if b.get("type") == "text")
        echoed = echo_text({"messages": [{"content": last}]})
        text = reply.text if reply.text is not None else echoed
        choice = body.get("tool_choice") or {}
        content: list[dict[str, Any]]
        if choice.get("type") == "tool":
            try:
                given = json.loads(text)
            except ValueError:
                given = {"text": text}
            content = [
                {"type": "tool_use", "id": "toolu_test", "name": choice["name"], "input": given}
            ]
            stop = "tool_use"
        else:
            content, stop = [{"type": "text", "text": text}], "end_turn"
        uncached, written, read = self._prompt_cache(body)
        return {
            "id": f"msg_test_{len(self._requests)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {
                "input_tokens": uncached,
                "output_tokens": len(text.split()),
                "cache_creation_input_tokens": written,
                "cache_read_input_tokens": read,
                **(reply.usage or {}),
            },
        }

    def _error(self, reply: Reply, message: str) -> Any:
        kind = reply.error_type or ANTHROPIC_ERROR_TYPES.get(reply.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _streamed(self, body: Any) -> bool:
        return isinstance(body, dict) and body.get("stream") is True

    def _stream(self, req: _Handler, reply: Reply, body: Any, arrived: float) -> None:
        self._stopping.wait(max(0.0, arrived + self.begins_s - time.monotonic()))
        answer = self._answer(reply, req.path, body)
        usage = answer["usage"]
        start = {
            **answer,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 1},
        }
        try:
            req.send_response(200)
            req.send_header("Content-Type", "text/event-stream")
            req.send_header("Cache-Control", "no-cache")
            req.send_header("Transfer-Encoding", "chunked")
            for name, value in reply.headers.items():
                req.send_header(name, value)
            req.end_headers()
            _send_events(req, ("message_start", {"type": "message_start", "message": start}))
            _send_events(req, ("ping", {"type": "ping"}))
            if reply.error is not None:
                kind = reply.error_type or "overloaded_error"
                error = {"type": "error", "error": {"type": kind, "message": reply.error}}
                _send_events(req, ("error", error))
            else:
                self._stopping.wait(max(0.0, arrived + reply.delay_s - time.monotonic()))
                self._billed(answer)
                _send_events(req, *_content_events(answer))
            req.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            req.close_connection = True

    def _limited(self, retry_after_s: int) -> Reply:
        return Reply(
            status=429,
            headers={"retry-after": str(retry_after_s)},
            error=f"Number of requests has exceeded your rate limit ({self.requests_per_window} "
            f"per {self.window_s:g}s)",
        )


class AzureOpenAITestServer(OpenAITestServer):
    """See the module docstring. ``url`` is the endpoint to give ``AzureOpenAIChat``;
    ``deployments`` maps each deployment's name to its model."""

    def __init__(
        self,
        *,
        deployments: Mapping[str, str] | None = None,
        api_key: str = "azure-test-key",
        ad_token: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.deployments = dict(deployments or {"test-deployment": "gpt-4o-mini"})
        self.api_key = api_key
        self.ad_token = ad_token

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _refuse(self, path: str, body: Any, headers: Mapping[str, str]) -> Reply | None:
        parts = urlsplit(path)
        segments = parts.path.strip("/").split("/")
        if (
            len(segments) != 5
            or segments[:2] != ["openai", "deployments"]
            or segments[3:] != ["chat", "completions"]
            or not parse_qs(parts.query).get("api-version")
        ):
            return Reply(status=404, error="Resource not found", error_type="404")
        bearer = headers.get("authorization", "")
        if headers.get("api-key") != self.api_key and not (
            self.ad_token is not None and bearer == f"Bearer {self.ad_token}"
        ):
            return Reply(
                status=401,
                error_type="401",
                error="Access denied due to invalid subscription key or wrong API endpoint. "
                "Make sure to provide a valid key for an active subscription and use a correct "
                "regional API endpoint for your resource.",
            )
        if segments[2] not in self.deployments:
            return Reply(
                status=404,
                error_type="DeploymentNotFound",
                error="The API deployment for this resource does not exist. If you created the "
                "deployment within the last 5 minutes, please wait a moment and try again.",
            )
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return Reply(
                status=400,
                error_type="BadRequest",
                error="'messages' is a required property",
            )
        return None

    def _answer(self, reply: Reply, path: str, body: Any) -> Any:
        payload = super()._answer(reply, path, body)
        payload["model"] = self.deployments[urlsplit(path).path.strip("/").split("/")[2]]
        return payload

    def _error(self, reply: Reply, message: str) -> Any:
        return {"error": {"code": reply.error_type or str(reply.status), "message": message}}
