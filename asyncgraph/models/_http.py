"""``HttpChatModel``: what every HTTP model client shares (pools, one POST, status errors).

A provider's client (``OpenAIChat``, ``AzureOpenAIChat``, ``AnthropicChat``) says where
it posts, with which headers, what body, and how to read the answer and the error body;
this base sends it with one HTTP connection pool per running event loop, maps every
transport failure to a ``ModelError`` (retryable or not, as ``BaseChatModel`` retries),
and turns an HTTP status into the matching ``ModelStatusError`` with the server's
message and its Retry-After. Headers (where the API keys are) never appear in a message,
a log line or a repr.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import ssl
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.lowlevel

from asyncgraph._exceptions import (
    ModelConfigError,
    ModelConnectionError,
    ModelContextError,
    ModelError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelRequestTimeoutError,
    ModelResponseError,
    ModelServerError,
    ModelStatusError,
    ModelTimeoutError,
)
from asyncgraph._redact import (
    RedactingFilter,
    header_secrets,
    redact,
    redact_url,
    register_secret,
    secret_values,
    url_secrets,
)
from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache
from asyncgraph.models._limits import context_refusal
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry, parse_retry_after
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter

if TYPE_CHECKING:  # httpx loads with a model's first request, not with asyncgraph.models
    import httpx

__all__ = [
    "EventStream",
    "HttpChatModel",
    "checked_http_url",
    "error_body_message",
    "join_url",
    "status_error_kind",
]

logger = logging.getLogger("asyncgraph.models")
# httpx logs every request's URL at INFO, a base URL's ``?api-key=`` and password included:
# its records are redacted before any handler (the application's too) formats them.
logging.getLogger("httpx").addFilter(RedactingFilter())


def checked_http_url(url: object, *, variable: str, example: str) -> str:
    """``url`` stripped of spaces and trailing ``/``; ``ModelConfigError`` naming
    ``variable`` unless it is an absolute ``http(s)://`` URL."""
    text = url.strip() if isinstance(url, str) else ""
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ModelConfigError(
            f"{variable} {redact_url(str(url))!r} is not an http:// or https:// URL: "
            f"expected something like {example}",
            variable=variable,
            value=redact_url(str(url)),
        )
    return text.rstrip("/")


def join_url(base: str, path: str) -> str:
    """``path`` appended to ``base``'s path, ``base``'s query kept after it (an Azure-style
    base URL carries ``?api-version=...``)."""
    parts = urlsplit(base)
    return urlunsplit(
        (parts.scheme, parts.netloc, parts.path.rstrip("/") + path, parts.query, parts.fragment)
    )


class HttpChatModel(BaseChatModel):
    """A model answered by ``POST``-ing JSON to an HTTP endpoint (see the module docstring).

    Subclasses resolve where they post and with which key, and pass on the options every
    client takes: the ``url`` they post to, the ``base_url`` it is under (shown in the
    repr; the cache key's endpoint unless ``cache_endpoint`` says otherwise), their
    ``headers`` and the ``secrets`` they hold (API keys; what ``url`` carries and the
    credential headers' values are added, and all are registered: masked in every output
    of the process), the ``default_params`` sent under every call's own, and the limits
    (``max_tokens``, ``max_concurrency``, ``context_tokens``; see ``BaseChatModel``).
    They give the JSON body they send (``_body``) and read the answer from the JSON reply
    (``_completion``), and may override ``_server_message`` (how their error bodies read)
    and ``_status_hints``. Everything shown (messages, the server's words, the answer's
    text through ``_redact``) has those secrets and the environment's masked.
    """

    _status_hints: Mapping[int, str] = {}
    _answer_kind = "an answer of this API"
    structured_outputs = True
    reply_tokens_param: str | None = "max_tokens"

    # A call's params only become fields of the JSON body posted to ``url`` with this
    # client's headers: none changes where it goes (see NOTE [Outbound policy]).
    request_params = None

    def __init__(
        self,
        model: str,
        *,
        url: str,
        base_url: str,
        headers: Mapping[str, str],
        secrets: Iterable[str] = (),
        default_params: Mapping[str, Any] | None,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        retry: Retry | None,
        rate_limit: RateLimit | RateLimiter | None,
        cache: Cache | None,
        pricing: Pricing | None,
        usage: UsageMeter | None,
        max_tokens: int | None,
        max_concurrency: int | None,
        context_tokens: int | None,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s!r}, "
                f"connect_timeout_s={connect_timeout_s!r}"
            )
        super().__init__(
            model, retry=retry, rate_limit=rate_limit, cache=cache, pricing=pricing, usage=usage
        )
        self._set_limits(max_tokens, max_concurrency, context_tokens)
        self.model = model
        self.base_url = base_url
        self.default_params = dict(default_params or {})
        self.url = url
        own = {*secrets, *url_secrets(url), *header_secrets(headers)} - {""}
        for secret in own:  # masked in every output of the process from now on
            register_secret(secret)
        self._secrets = sorted({*own, *secret_values()}, key=len, reverse=True)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._headers = {"content-type": "application/json", **headers}
        self._max_connections = max_connections
        self._ssl_context = _default_ssl_context()
        self._lock = threading.Lock()
        # One pool per event loop (keyed by the loop object, so it goes with the loop): a
        # pool's connections belong to the loop that opened them and fail in any other.
        self._clients: weakref.WeakKeyDictionary[object, _LoopClient] = weakref.WeakKeyDictionary()

    @property
    def cache_endpoint(self) -> str:
        return redact_url(self.base_url)

    @property
    def _shown_url(self) -> str:
        """``url`` as messages show it (credentials in it masked)."""
        return redact_url(self.url)

    def cache_request(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The URL (credentials masked) and the JSON body sent (``default_params``
        included), for the cache key and the call log."""
        return {"url": self._shown_url, "body": self._body(messages, params)}

    def _body(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON body this API takes for ``messages`` and ``params``."""
        raise NotImplementedError

    def _completion(self, data: Any, params: Mapping[str, Any]) -> Completion:
        """The answer in the JSON reply ``data`` to a call with ``params``; raises
        ``KeyError`` / ``TypeError`` / ... when ``data`` is not one."""
        raise NotImplementedError

    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        response = await self._post(self._body(messages, params))
        try:
            completion = self._completion(response.json(), params)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise self._not_an_answer(response, exc) from exc
        # A reply that quotes the key (a server echoing its request) must not carry it on.
        return dataclasses.replace(completion, text=self._redact(completion.text))

    def _redact(self, text: str) -> str:
        """``text`` without this client's secrets, the environment's, URL credentials."""
        return redact(text, self._secrets)

    def _new_client(self) -> httpx.AsyncClient:
        import httpx

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
            logger.debug("%s: closing a failed HTTP client failed", self.name, exc_info=True)

    async def _prepare(self) -> None:
        await self._http()

    def _maybe_billed(self, error: ModelError) -> bool:
        """Not when the request never left: no connection could be opened or taken."""
        import httpx

        # Failures before the request left this process: nothing reached the server.
        never_sent = (
            httpx.ConnectError,
            httpx.ConnectTimeout,
            httpx.PoolTimeout,
            httpx.UnsupportedProtocol,
        )
        if isinstance(error.__cause__, never_sent):
            return False
        return super()._maybe_billed(error)

    async def _post(self, body: Mapping[str, Any]) -> httpx.Response:
        """One POST of ``body`` to ``url``; a 2xx response, else a ``ModelError``."""
        async with self._sending() as client:
            response = await client.post(self.url, json=body)
        if response.status_code >= 300:
            raise self._context_error(response) or self._status_error(response)
        return response

    async def _post_stream(
        self, body: Mapping[str, Any], on_event: Callable[[str, Any], None]
    ) -> None:
        """One POST of ``body`` answered with server-sent events: ``on_event(name, data)``
        for each event as it comes (``data`` parsed from JSON; it may raise a
        ``ModelError``, or ``ValueError`` / ``KeyError`` / ``TypeError`` for an event that
        is not what the API sends), within ``timeout_s`` in all; an error status raises
        as ``_post``'s does. A server that answers with one JSON body instead (a proxy
        that does not stream) gives it as one event named ``"message"``."""
        async with self._sending() as client:
            async with client.stream("POST", self.url, json=body) as response:
                if response.status_code >= 300:
                    await response.aread()
                    raise self._context_error(response) or self._status_error(response)
                failed: ModelError | None = None
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    await response.aread()
                    failed = self._dispatch(on_event, "message", response.text)
                else:
                    failed = await self._read_events(response, on_event)
                if failed is not None:
                    raise failed

    async def _read_events(
        self, response: httpx.Response, on_event: Callable[[str, Any], None]
    ) -> ModelError | None:
        """Each event of ``response`` to ``on_event``; the error the first failing one met."""
        events = EventStream()
        chunks = response.aiter_bytes()
        async for chunk in chunks:
            for name, data in events.feed(chunk):
                failed = self._dispatch(on_event, name, data)
                if failed is not None:
                    break
            else:
                continue
            # The rest is read (a stream left half read leaves httpx's generators to the
            # garbage collector: a warning on trio), but not into the request's deadline,
            # which would turn this error into a timeout.
            with anyio.CancelScope(deadline=anyio.current_effective_deadline() - 0.1):
                async for _ in chunks:
                    pass
            return failed
        return None

    def _dispatch(
        self, on_event: Callable[[str, Any], None], name: str, data: str
    ) -> ModelError | None:
        """``on_event`` of one event; the error it met, as a ``ModelError``, else None."""
        try:
            on_event(name, json.loads(data))
        except ModelError as exc:
            return exc
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            error = ModelResponseError(
                f"{self.name!r}: the event stream from {self._shown_url} is not "
                f"{self._answer_kind}: a {name!r} event ({type(exc).__name__}: "
                f"{self._redact(str(exc))}) reads {self._redact(data[:300])!r}",
                model=self.name,
            )
            error.__cause__ = exc
            return error
        return None

    @asynccontextmanager
    async def _sending(self) -> AsyncIterator[httpx.AsyncClient]:
        """The event loop's HTTP client for one request, within ``timeout_s``; what the
        transport raises becomes a ``ModelError`` (``ModelError``s pass as they are)."""
        import httpx

        client = await self._http()
        try:
            with anyio.fail_after(self.timeout_s):
                yield client
        except ModelError:
            raise
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ModelTimeoutError(
                f"{self.name!r}: no answer from {self._shown_url} within "
                f"timeout_s={self.timeout_s:g} (connect_timeout_s={self.connect_timeout_s:g}); "
                "raise timeout_s for long answers",
                model=self.name,
            ) from exc
        except httpx.TransportError as exc:
            raise ModelConnectionError(
                f"{self.name!r}: connection to {self._shown_url} failed: "
                f"{type(exc).__name__}: {self._redact(str(exc) or 'connection closed')}",
                model=self.name,
            ) from exc
        except httpx.HTTPError as exc:
            raise ModelResponseError(
                f"{self.name!r}: the answer from {self._shown_url} could not be read: "
                f"{type(exc).__name__}: {self._redact(str(exc))}",
                model=self.name,
            ) from exc
        except (RuntimeError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # Not an error httpx maps (e.g. a connection tied to another event loop): the
            # pool may be unusable, so the retry starts from a new one.
            await self._discard_client(client)
            raise ModelConnectionError(
                f"{self.name!r}: the HTTP transport to {self._shown_url} failed unexpectedly: "
                f"{type(exc).__name__}: {self._redact(str(exc))}; this event loop's "
                "connections were reset",
                model=self.name,
            ) from exc

    def _context_error(self, response: httpx.Response) -> ModelContextError | None:
        """A 400 that refuses the request for the context window, as ``ModelContextError``
        (see ``asyncgraph.models._limits.context_refusal``), else None."""
        if response.status_code != 400:
            return None
        try:
            data = response.json()
        except ValueError:
            data = None
        server_message = self._redact(self._server_message(response))
        refusal = context_refusal(data, server_message)
        if refusal is None:
            return None
        prompt, context = refusal
        return ModelContextError(
            f"{self.name!r}: HTTP 400 from {self._shown_url}, the request does not fit the "
            f"model's context window: {server_message} (asyncgraph sizes requests to the "
            "window it knows: set context_tokens= on the model to the server's window per "
            "slot, or send less)",
            model=self.name,
            prompt_tokens=prompt,
            context_tokens=context,
            status_code=400,
        )

    def _server_message(self, response: httpx.Response) -> str:
        """What the server said in an error body (default: OpenAI's ``error.message``)."""
        return error_body_message(response)

    def _status_error(self, response: httpx.Response) -> ModelStatusError:
        status = response.status_code
        server_message = self._redact(self._server_message(response))
        retry_after_s = parse_retry_after(response.headers)
        cls, what = status_error_kind(status)
        hint = self._status_hints.get(status)
        message = f"{self.name!r}: HTTP {status} from {self._shown_url}, {what}: {server_message}"
        if hint:
            message += f" ({hint})"
        return cls(
            message,
            model=self.name,
            status_code=status,
            server_message=server_message,
            retry_after_s=retry_after_s,
        )

    def _not_an_answer(self, response: httpx.Response, exc: Exception) -> ModelResponseError:
        return ModelResponseError(
            f"{self.name!r}: HTTP {response.status_code} from {self._shown_url} is not "
            f"{self._answer_kind} ({type(exc).__name__}: {self._redact(str(exc))}); body "
            f"starts {self._redact(response.text[:300])!r}",
            model=self.name,
        )

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
        return f"{type(self).__name__}({self.model!r}, base_url={redact_url(self.base_url)!r})"


@functools.cache
def _default_ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once per process and shared by every client:
    loading the CA bundle takes tens of milliseconds, and a context is safe to share."""
    import httpx

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


_LINE_END = re.compile(rb"\r\n|\r|\n")


class EventStream:
    """Server-sent events read from the bytes of a stream, as the SSE specification reads
    them: a line ends at CRLF, LF or CR (nothing else: a JSON string may hold U+2028); a
    blank line ends an event; ``event:`` names it (``"message"`` by default), its
    ``data:`` lines are joined with LF; comments (``:``) and other fields are skipped; an
    event the stream ends in the middle of is dropped."""

    def __init__(self) -> None:
        self._pending = b""
        self._after_cr = False  # the last chunk ended in CR: a LF first is its CRLF
        self._name = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        """The events this chunk completes: ``(name, data)`` each."""
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        *lines, self._pending = _LINE_END.split(self._pending + chunk)
        events = []
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            if not line:
                if self._data:
                    events.append((self._name or "message", "\n".join(self._data)))
                self._name, self._data = "", []
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "event":
                    self._name = value
                elif field == "data":
                    self._data.append(value)
        return events


def status_error_kind(status: int) -> tuple[type[ModelStatusError], str]:
    """The ``ModelStatusError`` for an HTTP error ``status``, and how a message says it:
    429 rate limited, 408 timed out, 5xx a server error (these are retried), any other
    rejected (not retried)."""
    if status == 429:
        return ModelRateLimitedError, "rate limited by the server"
    if status == 408:
        return ModelRequestTimeoutError, "the server timed out waiting for the request"
    if status >= 500:
        return ModelServerError, "server error"
    return ModelRequestError, "request rejected (not retried)"


def error_body_message(response: httpx.Response) -> str:
    """The ``error.message`` of an OpenAI- or Anthropic-style error body (with Anthropic's
    ``error.type`` before it), else the start of the body."""
    try:
        data = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = str(error["message"])
            if data.get("type") == "error" and isinstance(error.get("type"), str):
                return f"{error['type']}: {message}"
            return message
        if isinstance(error, str):
            return error
        if isinstance(data.get("message"), str):
            return str(data["message"])
    text = response.text.strip()
    return text[:500] if text else response.reason_phrase or "(empty body)"
