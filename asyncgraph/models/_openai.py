"""``OpenAIChat``: a client of the OpenAI-compatible chat completions HTTP API."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import anyio

from asyncgraph._exceptions import ModelConfigError, ModelConnectionError
from asyncgraph._redact import redact_url
from asyncgraph.models._cache import Cache
from asyncgraph.models._http import HttpChatModel, checked_http_url, join_url
from asyncgraph.models._prices import context_window
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter
from asyncgraph.models._warming import leading_prefix_key

__all__ = ["DEFAULT_BASE_URL", "OpenAIChat", "chat_completion"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"

_STATUS_HINTS = {
    400: "check the messages and params",
    401: "check the API key (api_key= or OPENAI_API_KEY)",
    403: "check the API key's permissions for this model",
    404: "check the model name and base_url",
    422: "check the messages and params",
}


class OpenAIChat(HttpChatModel):
    """A model behind an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint.

    Works with OpenAI and with compatible servers (vLLM, Ollama, LiteLLM, llama.cpp, ...),
    under asyncio and trio (``httpx.AsyncClient``). ``base_url`` defaults to
    ``OPENAI_BASE_URL`` or ``https://api.openai.com/v1``; ``api_key`` to ``OPENAI_API_KEY``
    (required for api.openai.com, optional elsewhere). Each attempt must finish within
    ``timeout_s`` (an overall deadline, covering connect, send and read) and connect within
    ``connect_timeout_s``. ``default_params`` are sent with every request (e.g.
    ``{"temperature": 0}``), under the per-call params, and are part of the cache key;
    ``headers`` are added to each request. Retries, rate limit, cache, pricing and usage:
    see ``BaseChatModel``. The usage of an answer counts the prompt tokens OpenAI served
    from its prompt cache (``usage.prompt_tokens_details.cached_tokens``) as
    ``cache_read_tokens``, priced at the ``Pricing``'s cached-input rate.

    Limits (see ``BaseChatModel``): ``context_tokens``, ``max_concurrency`` and
    ``max_tokens`` as given; else, from a server other than api.openai.com, as it says
    (llama.cpp's ``GET /props``: ``default_generation_settings.n_ctx``, the window of one
    slot, and ``total_slots``; vLLM's ``GET {base_url}/models``: ``max_model_len``), else
    the context window from the dated table. A reply's size is sent as ``max_tokens``
    (``max_completion_tokens`` to api.openai.com, which wants it for its newer models).
    To api.openai.com, the requests of a step that share their first 1,024 tokens wait
    for the first of them to be answered, then read that prefix from OpenAI's cache (NOTE
    [Cache warming]; ``warm_cache=True`` on the instance does the same for another server,
    ``False`` turns it off).

    One model may serve several event loops, one after another (consecutive
    ``anyio.run`` calls, asyncio then trio) or at once (threads): it keeps one HTTP
    connection pool per running event loop. ``aclose()`` closes the pool of the loop it
    runs in; the pool of a loop that ends without it is closed by that loop's shutdown
    (``asyncio.run``, ``anyio.run`` and ``trio.run`` finalize it), never reused elsewhere.

    Errors: a 4xx other than 408 / 429 raises ``ModelRequestError`` with ``status_code``
    and the server's ``server_message``; 408 / 429 / 5xx / connection errors / timeouts are
    retried and end in ``ModelRetryError``. Any other transport failure is a
    ``ModelConnectionError`` too, never a bare ``RuntimeError``. Close with ``await
    model.aclose()`` or ``async with``::

        async with OpenAIChat("gpt-4o-mini", pricing=Pricing(0.15, 0.60)) as model:
            answer = await model.complete([{"role": "user", "content": "Hi"}], temperature=0)
            print(answer.text, model.usage.snapshot().cost_usd)
    """

    _status_hints = _STATUS_HINTS
    _answer_kind = "a chat completion"

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
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
        max_tokens: int | None = None,
        max_concurrency: int | None = None,
        context_tokens: int | None = None,
    ) -> None:
        if not model:
            raise ValueError("OpenAIChat needs a model name, e.g. OpenAIChat('gpt-4o-mini')")
        chosen = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        source = "base_url" if base_url else "OPENAI_BASE_URL"
        checked = checked_http_url(
            chosen,
            variable=source,
            example="https://api.openai.com/v1 or http://localhost:8000/v1 (an "
            "OpenAI-compatible endpoint)",
        )
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not key and checked == DEFAULT_BASE_URL:
            raise ModelConfigError(
                f"OPENAI_API_KEY is not set: model {model!r} at api.openai.com needs an API "
                f"key. Set OPENAI_API_KEY (or pass api_key=...); for a local "
                f"OpenAI-compatible server that needs none, pass its base_url",
                variable="OPENAI_API_KEY",
                value="",
            )
        auth = {"authorization": f"Bearer {key}"} if key else {}
        super().__init__(
            model,
            url=join_url(checked, "/chat/completions"),
            base_url=checked,
            headers={**(headers or {}), **auth},
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
        if checked == DEFAULT_BASE_URL:
            self.reply_tokens_param = "max_completion_tokens"

    def _body(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.default_params, **params, "model": self.model, "messages": messages}

    def _table_context_tokens(self) -> int | None:
        return context_window(self.model)

    def _suggested_reply_tokens(
        self, params: Mapping[str, Any], context_tokens: int | None = None
    ) -> int | None:
        """None for OpenAI's reasoning models (o1, o3, o4-mini, gpt-5...): their
        ``max_completion_tokens`` counts the reasoning too, which a reply's size would cut
        short (give the model ``max_tokens=`` to bound them)."""
        if _REASONING.match(self.model):
            return None
        return super()._suggested_reply_tokens(params, context_tokens)

    def _cache_prefix(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> str | None:
        """The first 1,024 tokens, to OpenAI's own API (it caches them; other servers have
        caches of their own) or when ``warm_cache`` is True (NOTE [Cache warming])."""
        if self.warm_cache is None and self.base_url != DEFAULT_BASE_URL:
            return None
        return leading_prefix_key(self.model, messages, self.estimator.chars_per_token)

    async def _discover(self) -> tuple[int | None, int | None]:
        """llama.cpp's ``/props`` (beside the ``/v1`` base URL), else vLLM's ``/models``;
        nothing asked of api.openai.com (the table knows its models)."""
        if self.base_url == DEFAULT_BASE_URL:
            return None, None
        client = await self._http()
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        props = await self._get_json(client, join_url(root, "/props"))
        if isinstance(props, dict):
            slots = _positive(props.get("total_slots"))
            settings = props.get("default_generation_settings")
            context = _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None
            if context is not None or slots is not None:
                return context, slots
        listed = await self._get_json(client, join_url(self.base_url, "/models"))
        rows = listed.get("data") if isinstance(listed, dict) else None
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, dict) and row.get("id") in (self.model, None):
                return _positive(row.get("max_model_len")), None
        if isinstance(rows, list) and len(rows) == 1 and isinstance(rows[0], dict):
            return _positive(rows[0].get("max_model_len")), None
        return None, None

    async def _get_json(self, client: Any, url: str) -> Any:
        """The JSON of ``GET url`` (None for an error status or a body that is not JSON);
        ``ModelConnectionError`` when the server cannot be reached."""
        try:
            with anyio.fail_after(min(self.timeout_s, 10.0)):
                response = await client.get(url)
        except Exception as exc:  # any transport failure: the limits stay unknown
            raise ModelConnectionError(
                f"{self.name!r}: {redact_url(url)} could not be read: {type(exc).__name__}",
                model=self.name,
            ) from exc
        if response.status_code != 200:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    def _completion(self, data: Any, params: Mapping[str, Any]) -> Completion:
        return chat_completion(data, self.model)


_REASONING = re.compile(r"^(o\d|gpt-5)")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def chat_completion(data: Any, model: str) -> Completion:
    """The ``Completion`` of a chat completions answer (OpenAI's, Azure's, a compatible
    server's): the first choice's text, and the usage with its prompt-cache share.
    Raises ``KeyError`` / ``TypeError`` / ... for a body that is not one."""
    choice = data["choices"][0]
    content = choice["message"].get("content")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        text=content if isinstance(content, str) else "",
        model=str(data.get("model") or model),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=choice.get("finish_reason"),
        cache_read_tokens=int(details.get("cached_tokens") or 0),
    )
