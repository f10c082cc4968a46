"""``OpenAIChat``: a client of the OpenAI-compatible chat completions HTTP API."""

from __future__ import annotations

import functools
import json
import logging
import os
import ssl
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import httpx

from asyncgraph._exceptions import (
    ModelConfigError,
    ModelConnectionError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelRequestTimeoutError,
    ModelResponseError,
    ModelServerError,
    ModelStatusError,
    ModelTimeoutError,
)
from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry, parse_retry_after
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter

__all__ = ["DEFAULT_BASE_URL", "OpenAIChat"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"

logger = logging.getLogger("asyncgraph.models")

_STATUS_HINTS = {
    400: "check the messages and params",
    401: "check the API key (api_key= or OPENAI_API_KEY)",
    403: "check the API key's permissions for this model",
    404: "check the model name and base_url",
    422: "check the messages and params",
}


class OpenAIChat(BaseChatModel):
    """A model behind an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint.

    Works with OpenAI and with compatible servers (vLLM, Ollama, LiteLLM, llama.cpp, ...),
    under asyncio and trio (``httpx.AsyncClient``). ``base_url`` defaults to
    ``OPENAI_BASE_URL`` or ``https://api.openai.com/v1``; ``api_key`` to ``OPENAI_API_KEY``
    (required for api.openai.com, optional elsewhere). Each attempt must finish within
    ``timeout_s`` (an overall deadline, covering connect, send and read) and connect within
    ``connect_timeout_s``. ``default_params`` are sent with every request (e.g.
    ``{"temperature": 0}``), under the per-call params, and are part of the cache key;
    ``headers`` are added to each request. Retries, rate limit, cache, pricing and usage:
    see ``BaseChatModel``.

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
    ) -> None:
        if not model:
            raise ValueError("OpenAIChat needs a model name, e.g. OpenAIChat('gpt-4o-mini')")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s!r}, "
                f"connect_timeout_s={connect_timeout_s!r}"
            )
        super().__init__(
            model, retry=retry, rate_limit=rate_limit, cache=cache, pricing=pricing, usage=usage
        )
        self.model = model
        chosen = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        if (
            not isinstance(chosen, str)
            or urlsplit(chosen.strip()).scheme.lower()
            not in (
                "http",
                "https",
            )
            or not urlsplit(chosen.strip()).netloc
        ):
            source = "base_url" if base_url else "OPENAI_BASE_URL"
            raise ModelConfigError(
                f"{source} {chosen!r} is not an http:// or https:// URL: an OpenAI-compatible "
                f"endpoint looks like https://api.openai.com/v1 or http://localhost:8000/v1",
                variable="OPENAI_BASE_URL" if source == "OPENAI_BASE_URL" else "base_url",
                value=str(chosen),
            )
        self.base_url = chosen.strip().rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not key and self.base_url == DEFAULT_BASE_URL:
            raise ModelConfigError(
                f"OPENAI_API_KEY is not set: model {model!r} at api.openai.com needs an API "
                f"key. Set OPENAI_API_KEY (or pass api_key=...); for a local "
                f"OpenAI-compatible server that needs none, pass its base_url",
                variable="OPENAI_API_KEY",
                value="",
            )
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.default_params = dict(default_params or {})
        self._headers = {"content-type": "application/json", **(headers or {})}
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._max_connections = max_connections
        self._ssl_context = _default_ssl_context()
        self._lock = threading.Lock()
        # One pool per event loop (keyed by the loop object, so it goes with the loop): a
        # pool's connections belong to the loop that opened them and fail in any other.
        self._clients: weakref.WeakKeyDictionary[object, _LoopClient] = weakref.WeakKeyDictionary()

    @property
    def cache_endpoint(self) -> str:
        return self.base_url

    def cache_request(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The URL and the JSON body sent (``default_params`` included), for the cache key."""
        return {"url": self.url, "body": self._body(messages, params)}

    def _body(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.default_params, **params, "model": self.model, "messages": messages}

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            headers=self._headers,
            timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
            limits=httpx.Limits(max_connections=self._max_connections),
            verify=self._ssl_context,
        )

    async def _http(self) -> httpx.AsyncClient:
        """The HTTP client of the running event loop, opened on first use."""
        loop = anyio.lowlevel.current_token().native_token
        with self._lock:
            entry = self._clients.get(loop)
            if entry is None:
                client = self._new_client()
                entry = _LoopClient(client, _close_at_loop_end(loop, client, self._forgetter()))
                self._clients[loop] = entry
                fresh = True
            else:
                fresh = False
        if fresh:
            await _keep_until_loop_end(loop, entry)
        return entry.client

    def _forgetter(self) -> Callable[[object, httpx.AsyncClient], None]:
        """Forgets a closed client; holds the model weakly, so a dropped model can go."""
        model = weakref.ref(self)

        def forget(loop: object, client: httpx.AsyncClient) -> None:
            self_ = model()
            if self_ is None:
                return
            with self_._lock:
                entry = self_._clients.get(loop)
                if entry is not None and entry.client is client:
                    del self_._clients[loop]

        return forget

    async def _discard_client(self, client: httpx.AsyncClient) -> None:
        """Drop a client whose transport failed unexpectedly; the next attempt opens anew."""
        loop = anyio.lowlevel.current_token().native_token
        with self._lock:
            entry = self._clients.get(loop)
            if entry is None or entry.client is not client:
                return
            del self._clients[loop]
        try:
            await entry.closer.aclose()
        except Exception:  # it failed already; closing it is a courtesy
            logger.debug("%s: closing a failed HTTP client failed", self.model, exc_info=True)

    async def _prepare(self) -> None:
        await self._http()

    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        body = self._body(messages, params)
        client = await self._http()
        try:
            with anyio.fail_after(self.timeout_s):
                response = await client.post(self.url, json=body)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ModelTimeoutError(
                f"{self.model!r}: no answer from {self.url} within timeout_s={self.timeout_s:g} "
                f"(connect_timeout_s={self.connect_timeout_s:g}); raise timeout_s for long answers",
                model=self.model,
            ) from exc
        except httpx.TransportError as exc:
            raise ModelConnectionError(
                f"{self.model!r}: connection to {self.url} failed: "
                f"{type(exc).__name__}: {exc or 'connection closed'}",
                model=self.model,
            ) from exc
        except httpx.HTTPError as exc:
            raise ModelResponseError(
                f"{self.model!r}: the answer from {self.url} could not be read: "
                f"{type(exc).__name__}: {exc}",
                model=self.model,
            ) from exc
        except (RuntimeError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # Not an error httpx maps (e.g. a connection tied to another event loop): the
            # pool may be unusable, so the retry starts from a new one.
            await self._discard_client(client)
            raise ModelConnectionError(
                f"{self.model!r}: the HTTP transport to {self.url} failed unexpectedly: "
                f"{type(exc).__name__}: {exc}; this event loop's connections were reset",
                model=self.model,
            ) from exc
        if response.status_code >= 300:
            raise self._status_error(response)
        return self._parse(response)

    def _status_error(self, response: httpx.Response) -> ModelStatusError:
        status = response.status_code
        server_message = _server_message(response)
        retry_after_s = parse_retry_after(response.headers)
        cls: type[ModelStatusError]
        if status == 429:
            cls, what = ModelRateLimitedError, "rate limited by the server"
        elif status == 408:
            cls, what = ModelRequestTimeoutError, "the server timed out waiting for the request"
        elif status >= 500:
            cls, what = ModelServerError, "server error"
        else:
            cls, what = ModelRequestError, "request rejected (not retried)"
        hint = _STATUS_HINTS.get(status)
        message = f"{self.model!r}: HTTP {status} from {self.url}, {what}: {server_message}"
        if hint:
            message += f" ({hint})"
        return cls(
            message,
            model=self.model,
            status_code=status,
            server_message=server_message,
            retry_after_s=retry_after_s,
        )

    def _parse(self, response: httpx.Response) -> Completion:
        try:
            data = response.json()
            choice = data["choices"][0]
            content = choice["message"].get("content")
            usage = data.get("usage") or {}
            return Completion(
                text=content if isinstance(content, str) else "",
                model=str(data.get("model") or self.model),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                finish_reason=choice.get("finish_reason"),
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModelResponseError(
                f"{self.model!r}: HTTP {response.status_code} from {self.url} is not a chat "
                f"completion ({type(exc).__name__}: {exc}); body starts {response.text[:300]!r}",
                model=self.model,
            ) from exc

    async def aclose(self) -> None:
        """Close this event loop's HTTP connections (a later call opens new ones) and the
        middleware's. Other loops' connections close with their loop (or their aclose())."""
        loop = anyio.lowlevel.current_token().native_token
        with self._lock:
            entry = self._clients.pop(loop, None)
        with anyio.CancelScope(shield=True):
            if entry is not None:
                await entry.closer.aclose()
            await super().aclose()

    def __repr__(self) -> str:
        return f"OpenAIChat({self.model!r}, base_url={self.base_url!r})"


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once per process and shared by every client:
    loading the CA bundle takes tens of milliseconds, and a context is safe to share."""
    return httpx.create_ssl_context()


class _LoopClient(NamedTuple):
    client: httpx.AsyncClient
    closer: AsyncGenerator[None, None]


# The closers of every open client, per event loop, held until they run. A model that is
# dropped without aclose() leaves its clients here, and their loop closes them at its end
# instead of the garbage collector dropping open sockets (ResourceWarning) mid-run.
_closers_lock = threading.Lock()
_closers: weakref.WeakKeyDictionary[object, dict[httpx.AsyncClient, AsyncGenerator[None, None]]] = (
    weakref.WeakKeyDictionary()
)


async def _keep_until_loop_end(loop: object, entry: _LoopClient) -> None:
    with _closers_lock:
        _closers.setdefault(loop, {})[entry.client] = entry.closer
    # The first step registers the generator with the running loop, which finalizes it
    # (closing the client) when the loop shuts down.
    await entry.closer.asend(None)


async def _close_at_loop_end(
    loop: object,
    client: httpx.AsyncClient,
    forget: Callable[[object, httpx.AsyncClient], None],
) -> AsyncGenerator[None, None]:
    """Suspends until ``aclose()`` or the end of ``loop``, then closes ``client`` there.

    Event loops finalize the async generators still suspended when they shut down
    (``loop.shutdown_asyncgens()`` in ``asyncio.run``; ``trio.run`` does it too), in that
    loop: the one place a pool's connections can be closed politely.
    """
    try:
        yield
    finally:
        forget(loop, client)
        with _closers_lock:
            _closers.get(loop, {}).pop(client, None)
        with anyio.CancelScope(shield=True):
            await client.aclose()


def _server_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the start of the body."""
    try:
        data = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(data.get("message"), str):
            return str(data["message"])
    text = response.text.strip()
    return text[:500] if text else response.reason_phrase or "(empty body)"
