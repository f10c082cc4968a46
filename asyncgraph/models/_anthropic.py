"""``AnthropicChat``: a client of Anthropic's native Messages API (``POST /v1/messages``).

The request is built from the same OpenAI-shaped messages and params every asyncgraph
model takes, by pure functions (``messages_request``, ``messages_completion``) tested
against the documented wire format:

- ``system`` messages become the request's ``system`` field (a string, or text blocks
  when one carries ``cache_control`` or ``cache_prompt=True`` marks the last one), in
  the order they came; ``user`` / ``assistant`` messages keep their order;
- content parts: ``text`` stays text (its ``cache_control`` kept), an ``image_url``
  part becomes an ``image`` block (a ``data:`` URL as ``{"type": "base64",
  "media_type", "data"}``, an http(s) URL as ``{"type": "url", "url"}``); Anthropic's
  own blocks (``image``, ``document``, ``tool_use``, ``tool_result``) pass as they are;
- params: ``max_tokens`` (or ``max_completion_tokens``; required by the API, so the
  client's ``max_tokens`` default fills it), ``stop`` -> ``stop_sequences``,
  ``response_format`` (a JSON schema) -> one forced tool whose ``input`` is the
  answer's JSON; OpenAI params with no Anthropic meaning (``seed``, ``n``, penalties,
  ``logprobs``...) raise ``ValueError`` rather than being dropped unseen; any other
  param (``temperature``, ``top_p``, ``top_k``, ``metadata``, ``tools``, ``thinking``...)
  is sent as it is.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from asyncgraph._exceptions import (
    ModelConfigError,
    ModelConnectionError,
    ModelResponseError,
    ModelStatusError,
)
from asyncgraph.models._cache import Cache
from asyncgraph.models._http import (
    HttpChatModel,
    checked_http_url,
    join_url,
    status_error_kind,
)
from asyncgraph.models._prices import context_window
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter
from asyncgraph.models._warming import answer_begins, marked_prefix_key

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_ANTHROPIC_URL",
    "AnthropicChat",
    "messages_completion",
    "messages_request",
]

DEFAULT_ANTHROPIC_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096

_STATUS_HINTS = {
    400: "check the messages and params",
    401: "check the API key (api_key= or ANTHROPIC_API_KEY)",
    403: "check the API key's permissions for this model",
    404: "check the model name and base_url",
    413: "the request is larger than the API accepts: send fewer or smaller messages",
}

# OpenAI chat params the Messages API has no counterpart for: refused by name, not dropped.
_UNSUPPORTED = frozenset(
    {
        "seed",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "parallel_tool_calls",
        "user",
        "store",
        "modalities",
        "prediction",
        "reasoning_effort",
    }
)
_NATIVE_BLOCKS = frozenset({"image", "document", "tool_use", "tool_result"})
_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
# The HTTP status each of Anthropic's error types stands for (an error event in a stream
# carries only its type).
_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}
_WRAPPED = "value"  # the property a non-object schema is wrapped in (a tool takes objects)
_EPHEMERAL = {"type": "ephemeral"}


def _image_block(url: str, where: str) -> dict[str, Any]:
    if url.startswith("data:"):
        header, sep, data = url[len("data:") :].partition(",")
        media_type, _, encoding = header.partition(";")
        if not sep or encoding != "base64" or not media_type.startswith("image/"):
            raise ValueError(
                f"{where}: an image data URL must be data:image/...;base64,..., got {url[:60]!r}"
            )
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    if url.startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise ValueError(f"{where}: an image URL must be http(s):// or data:, got {url[:60]!r}")


def _blocks(content: Any, where: str, *, text_only: bool = False) -> str | list[dict[str, Any]]:
    """One message's content as the Messages API takes it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where}: content must be a str or a list of parts, got {content!r:.80}")
    blocks: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            block: dict[str, Any] = {"type": "text", "text": part["text"]}
        elif kind == "image_url" and not text_only:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            if not isinstance(url, str):
                raise ValueError(f"{at}: an image_url part needs a url, got {part!r:.80}")
            block = _image_block(url, at)
        elif kind in _NATIVE_BLOCKS and not text_only:
            block = dict(part)
        else:
            allowed = "text" if text_only else "text, image_url or Anthropic's own blocks"
            raise ValueError(f"{at}: a {kind!r} part cannot be sent to Anthropic (use {allowed})")
        if "cache_control" in part:
            block["cache_control"] = part["cache_control"]
        blocks.append(block)
    return blocks


def _system(parts: list[tuple[str, Any]], cache_prompt: bool) -> str | list[dict[str, Any]]:
    """The ``system`` field: a string, or text blocks when caching marks one."""
    blocks: list[dict[str, Any]] = []
    for where, content in parts:
        converted = _blocks(content, where, text_only=True)
        if isinstance(converted, str):
            blocks.append({"type": "text", "text": converted})
        else:
            blocks.extend(converted)
    if cache_prompt and blocks:
        blocks[-1] = {**blocks[-1], "cache_control": dict(_EPHEMERAL)}
    if any("cache_control" in b for b in blocks):
        return blocks
    return "\n\n".join(b["text"] for b in blocks)


def _structured_tool(response_format: Any) -> tuple[dict[str, Any], bool] | None:
    """The forced tool standing for ``response_format``, and whether its schema is wrapped."""
    if not isinstance(response_format, Mapping) or response_format.get("type") == "text":
        return None
    spec = response_format.get("json_schema")
    if response_format.get("type") != "json_schema" or not isinstance(spec, Mapping):
        raise ValueError(
            f"response_format {dict(response_format)!r:.120} has no Anthropic counterpart: "
            "give a JSON schema ({'type': 'json_schema', 'json_schema': {'name': ..., "
            "'schema': {...}}}), which is sent as a forced tool"
        )
    schema = dict(spec.get("schema") or {})
    wrapped = schema.get("type") != "object"
    if wrapped:  # a tool's input is an object: another schema travels inside one
        schema = {"type": "object", "properties": {_WRAPPED: schema}, "required": [_WRAPPED]}
    name = str(spec.get("name") or "response")
    tool = {
        "name": name,
        "description": str(
            spec.get("description") or "Give the answer as this tool's input, following its schema."
        ),
        "input_schema": schema,
    }
    return tool, wrapped


def messages_request(
    model: str,
    messages: list[dict[str, Any]],
    params: Mapping[str, Any],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    cache_prompt: bool = False,
) -> dict[str, Any]:
    """The Messages API body for OpenAI-shaped ``messages`` and ``params`` (see the module
    docstring). Raises ``ValueError`` / ``TypeError`` for what Anthropic cannot take."""
    rest = dict(params)
    unsupported = sorted(_UNSUPPORTED.intersection(rest))
    if unsupported:
        raise ValueError(
            f"{model!r}: params {unsupported} have no counterpart in Anthropic's Messages "
            "API; leave them out for this model"
        )
    system: list[tuple[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, where = message["role"], f"messages[{i}]"
        if role in ("system", "developer"):
            system.append((where, message["content"]))
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": _blocks(message["content"], where)})
        else:
            raise ValueError(
                f"{where}: role {role!r} cannot be sent to Anthropic (use system, user or "
                "assistant; tool results go in a user message's tool_result block)"
            )
    if not turns:
        raise ValueError(f"{model!r}: Anthropic needs at least one user message, not only system")
    limit = rest.pop("max_tokens", rest.pop("max_completion_tokens", max_tokens))
    body: dict[str, Any] = {"model": model, "max_tokens": limit}
    if system:
        body["system"] = _system(system, cache_prompt)
    body["messages"] = turns
    stop = rest.pop("stop", None)
    if stop is not None:
        rest["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    structured = _structured_tool(rest.pop("response_format", None))
    if structured is not None:
        tool, _ = structured
        rest["tools"] = [*rest.get("tools", ()), tool]
        rest["tool_choice"] = {"type": "tool", "name": tool["name"]}
    return {**rest, **body}


def messages_completion(data: Any, model: str, response_format: Any = None) -> Completion:
    """The ``Completion`` of a Messages API answer: its text blocks (or, for a request
    with ``response_format``, the forced tool's ``input`` as JSON), its stop reason in
    OpenAI's words, and its usage (``prompt_tokens`` counts cache writes and reads too).
    Raises ``KeyError`` / ``TypeError`` / ``ValueError`` for a body that is not one."""
    if data["type"] != "message":
        raise ValueError(f"type is {data['type']!r}, not 'message'")
    blocks = data["content"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    reason = data.get("stop_reason")
    finish = _STOP_REASONS.get(reason, reason) if isinstance(reason, str) else None
    structured = _structured_tool(response_format)
    if structured is not None:
        tool, wrapped = structured
        used = [b for b in blocks if b["type"] == "tool_use" and b["name"] == tool["name"]]
        if used:
            answer = used[0]["input"]
            if wrapped and isinstance(answer, Mapping) and _WRAPPED in answer:
                answer = answer[_WRAPPED]
            text, finish = json.dumps(answer, ensure_ascii=False), "stop"
    usage = data.get("usage") or {}
    write = int(usage.get("cache_creation_input_tokens") or 0)
    read = int(usage.get("cache_read_input_tokens") or 0)
    return Completion(
        text=text,
        model=str(data.get("model") or model),
        prompt_tokens=int(usage.get("input_tokens") or 0) + write + read,
        completion_tokens=int(usage.get("output_tokens") or 0),
        finish_reason=finish,
        cache_read_tokens=read,
        cache_write_tokens=write,
    )


class StreamedMessage:
    """A Messages API answer put together from its event stream, as Anthropic documents
    streaming: ``message_start`` carries the message (usage so far, no content), each
    content block comes as ``content_block_start``, its deltas (``text_delta``,
    ``input_json_delta`` for a tool's input, ``thinking_delta``, ``signature_delta``,
    ``citations_delta``) and ``content_block_stop``; ``message_delta`` gives the stop
    reason and the final usage; ``message_stop`` ends it. An ``error`` event raises the
    ``ModelStatusError`` its type stands for (``overloaded_error`` is a retried 529;
    its message passed through ``redact``); ``ping`` and event types not known here are
    skipped, as the docs ask. A whole answer (``type: message``, from a server that did
    not stream) is taken as it is. ``begun()`` is called at ``message_start``: the answer
    has begun."""

    def __init__(
        self,
        model: str,
        where: str,
        begun: Callable[[], None],
        redact: Callable[[str], str] = lambda text: text,
    ) -> None:
        self.model, self.where, self.begun, self.redact = model, where, begun, redact
        self._message: dict[str, Any] | None = None
        self._blocks: dict[int, dict[str, Any]] = {}
        self._partial: dict[int, str] = {}
        self._stopped = False

    def __call__(self, name: str, data: Any) -> None:
        kind = data.get("type", name)
        if kind == "message":  # the whole answer in one body
            self._message = dict(data)
            self._blocks = dict(enumerate(data["content"]))
            self._stopped = True
            self.begun()
        elif kind == "message_start":
            self._message = dict(data["message"])
            self.begun()
        elif kind == "content_block_start":
            self._blocks[int(data["index"])] = dict(data["content_block"])
        elif kind == "content_block_delta":
            self._delta(int(data["index"]), data["delta"])
        elif kind == "content_block_stop":
            index = int(data["index"])
            if index in self._partial:
                self._blocks[index]["input"] = json.loads(self._partial.pop(index) or "{}")
        elif kind == "message_delta":
            message = self._started(kind)
            message.update(data.get("delta") or {})
            final = {k: v for k, v in (data.get("usage") or {}).items() if v is not None}
            message["usage"] = {**(message.get("usage") or {}), **final}
        elif kind == "message_stop":
            self._stopped = True
        elif kind == "error":
            raise self._error(data.get("error") or {})

    def _delta(self, index: int, delta: Mapping[str, Any]) -> None:
        block = self._blocks[index]
        kind = delta["type"]
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "input_json_delta":
            self._partial[index] = self._partial.get(index, "") + delta["partial_json"]
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "citations_delta":
            block["citations"] = [*(block.get("citations") or ()), delta["citation"]]

    def _started(self, kind: str) -> dict[str, Any]:
        if self._message is None:
            raise ValueError(f"{kind} came before message_start")
        return self._message

    def _error(self, error: Mapping[str, Any]) -> ModelStatusError:
        kind = str(error.get("type") or "api_error")
        said = self.redact(str(error.get("message") or ""))
        status = _ERROR_STATUS.get(kind, 500)
        cls, what = status_error_kind(status)
        return cls(
            f"{self.model!r}: {kind} in the answer's event stream from {self.where}, {what}: "
            f"{said}",
            model=self.model,
            status_code=status,
            server_message=f"{kind}: {said}",
        )

    def message(self) -> dict[str, Any]:
        """The answer as the API's one-body reply has it; ``ValueError`` if the stream
        ended before ``message_stop``."""
        message = self._started("the end of the stream")
        if not self._stopped:
            raise ValueError("the event stream ended before message_stop")
        return {**message, "content": [self._blocks[i] for i in sorted(self._blocks)]}


class AnthropicChat(HttpChatModel):
    """A Claude model behind Anthropic's native Messages API (``POST {base_url}/v1/messages``).

    The same contract as ``OpenAIChat`` (retries with Retry-After on 408 / 429 / 5xx and
    Anthropic's 529 ``overloaded_error``, timeouts, rate limit, cache, usage, prices;
    asyncio and trio), taking the same OpenAI-shaped messages and params, translated as
    the module docstring says: system prompt as its own field, images, conversations,
    ``response_format`` served by a forced tool. ``base_url`` defaults to
    ``ANTHROPIC_BASE_URL`` or ``https://api.anthropic.com`` (a URL ending in ``/v1`` is
    taken as is); ``api_key`` to ``ANTHROPIC_API_KEY`` (required for api.anthropic.com),
    sent as ``x-api-key`` with ``anthropic-version: 2023-06-01``. ``max_tokens`` (the
    model's reply size, over the size asyncgraph suggests for what it asks) is sent when
    a call gives none, else the suggested size, else 4,096 (the API requires one). The
    context window comes from ``context_tokens=`` or the dated table. ``cache_prompt=True`` marks the system
    prompt ``cache_control: {"type": "ephemeral"}``, so repeated calls sharing it read it
    from Anthropic's prompt cache (content parts may carry their own ``cache_control``
    too). The usage counts cache writes and cache reads apart (``cache_write_tokens`` /
    ``cache_read_tokens``, inside ``prompt_tokens``), priced at the ``Pricing``'s
    cache-write and cached-input rates. The requests of a step that share a marked prefix
    of 1,024 tokens or more wait until the first of them has begun its answer (that one
    request is streamed, to see the moment), then read the prefix from the cache (NOTE
    [Cache warming]; ``warm_cache=False`` on the instance turns it off).

    Errors: Anthropic's error body (``{"type": "error", "error": {"type", "message"}}``)
    is the ``server_message`` (``"overloaded_error: Overloaded"``); 400 / 401 / 403 / 404
    / 413 raise ``ModelRequestError``, the rest as ``OpenAIChat``. Example::

        async with AnthropicChat("claude-sonnet-4-20250514", cache_prompt=True) as model:
            answer = await model.complete(
                [{"role": "system", "content": long_rules}, {"role": "user", "content": "Hi"}]
            )
            print(answer.text, answer.cache_read_tokens, model.usage.snapshot().cost_usd)
    """

    _status_hints = _STATUS_HINTS
    _answer_kind = "a Messages API answer"

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        max_tokens: int | None = None,
        cache_prompt: bool = False,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        retry: Retry | None = None,
        rate_limit: RateLimit | RateLimiter | None = None,
        cache: Cache | None = None,
        pricing: Pricing | None = None,
        usage: UsageMeter | None = None,
        headers: Mapping[str, str] | None = None,
        default_params: Mapping[str, Any] | None = None,
        max_connections: int = 100,
        max_concurrency: int | None = None,
        context_tokens: int | None = None,
    ) -> None:
        if not model:
            raise ValueError(
                "AnthropicChat needs a model name, e.g. AnthropicChat('claude-sonnet-4-20250514')"
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        chosen = base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_ANTHROPIC_URL
        checked = checked_http_url(
            chosen,
            variable="base_url" if base_url else "ANTHROPIC_BASE_URL",
            example="https://api.anthropic.com",
        )
        key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY")
        if not key and checked == DEFAULT_ANTHROPIC_URL:
            raise ModelConfigError(
                f"ANTHROPIC_API_KEY is not set: model {model!r} at api.anthropic.com needs an "
                "API key. Set ANTHROPIC_API_KEY (or pass api_key=...)",
                variable="ANTHROPIC_API_KEY",
                value="",
            )
        path = "/messages" if urlsplit(checked).path.rstrip("/").endswith("/v1") else "/v1/messages"
        auth = {"x-api-key": key} if key else {}
        super().__init__(
            model,
            url=join_url(checked, path),
            base_url=checked,
            headers={**(headers or {}), "anthropic-version": ANTHROPIC_VERSION, **auth},
            secrets=[key] if key else [],
            default_params=default_params,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            retry=retry,
            rate_limit=rate_limit,
            cache=cache,
            pricing=pricing,
            usage=usage,
            max_tokens=max_tokens,
            max_concurrency=max_concurrency,
            context_tokens=context_tokens,
        )
        self.cache_prompt = cache_prompt

    def _body(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        return messages_request(
            self.model,
            messages,
            {**self.default_params, **params},
            max_tokens=self.max_tokens or DEFAULT_MAX_TOKENS,
            cache_prompt=self.cache_prompt,
        )

    def _table_context_tokens(self) -> int | None:
        return context_window(self.model)

    def _cache_prefix(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> str | None:
        """Up to the request's last ``cache_control`` mark (NOTE [Cache warming])."""
        try:
            body = self._body(messages, params)
        except (TypeError, ValueError):  # complete() raises the same, with its message
            return None
        return marked_prefix_key(body, self.estimator.chars_per_token)

    def estimate_tokens(self, messages: Any, params: Mapping[str, Any]) -> int:
        """As ``BaseChatModel``'s, with the client's ``max_tokens`` as the answer's share
        when the call sets none (that is what is sent)."""
        if "max_tokens" in params or "max_completion_tokens" in params:
            return super().estimate_tokens(messages, params)
        return super().estimate_tokens(
            messages, {**params, "max_tokens": self.max_tokens or DEFAULT_MAX_TOKENS}
        )

    def _completion(self, data: Any, params: Mapping[str, Any]) -> Completion:
        response_format = {**self.default_params, **params}.get("response_format")
        return messages_completion(data, self.model, response_format)

    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        """As any HTTP model's, but the request that warms a prefix is streamed, so the
        others are released when its answer begins (NOTE [Cache warming])."""
        begun = answer_begins()
        if begun is None:
            return await super()._complete_once(messages, params)
        stream = StreamedMessage(self.name, self._shown_url, begun, self._redact)
        await self._post_stream({**self._body(messages, params), "stream": True}, stream)
        try:
            message = stream.message()
        except ValueError as exc:  # cut short (a proxy, a server that went away): retried
            raise ModelConnectionError(
                f"{self.name!r}: the event stream from {self._shown_url} was cut short: {exc}",
                model=self.name,
            ) from exc
        try:
            completion = self._completion(message, params)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModelResponseError(
                f"{self.name!r}: the event stream from {self._shown_url} is not "
                f"{self._answer_kind}: {type(exc).__name__}: {self._redact(str(exc))}",
                model=self.name,
            ) from exc
        return dataclasses.replace(completion, text=self._redact(completion.text))
