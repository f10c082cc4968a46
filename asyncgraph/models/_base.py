"""``BaseChatModel``: the middleware every model gets (cache, rate limit, retries, usage)."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, ClassVar, Self

import anyio
import anyio.lowlevel

from asyncgraph._exceptions import (
    ModelBackendError,
    ModelContextError,
    ModelError,
    ModelRetryError,
    ModelStatusError,
    ModelTimeoutError,
)
from asyncgraph._redact import redact, redact_url
from asyncgraph.models._cache import Cache, digest_request
from asyncgraph.models._calls import ModelCall, call_slot, notify_call, observing_calls
from asyncgraph.models._journal import CallJournal, current_journal
from asyncgraph.models._limits import (
    MIN_REPLY_TOKENS,
    ModelLimits,
    TokenEstimator,
    current_reply_tokens,
    request_chars,
)
from asyncgraph.models._outbound import CHAT_PARAMS, check_call_params
from asyncgraph.models._ratelimit import RateLimit, RateLimiter, make_rate_limiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion, Message, normalize_messages
from asyncgraph.models._usage import Pricing, UsageMeter, meters_for
from asyncgraph.models._warming import Warming

__all__ = ["BaseChatModel"]

logger = logging.getLogger("asyncgraph.models")

_RESERVED_PARAMS = frozenset({"model", "messages", "stream"})
_REPLY_PARAMS = ("max_tokens", "max_completion_tokens")
_DISCOVERY_TRIES = 3

# NOTE [Requests a server can serve]
# A local server (llama.cpp's llama-server, vLLM) has a few slots and a context window
# per slot; a request beyond the slots waits in the server's queue, where the client's
# timeout runs out while the server still works on it, and a request beyond the window
# is refused after the wait. So a model knows its limits (``limits()``: given, else from
# the server, else from the dated table) and every request is shaped to them before it
# leaves: its reply's ``max_tokens`` (the call's, the model's, else what the code asking
# suggested with ``reply_tokens``) cut to the room the window leaves, and a request with
# no room refused here with ``ModelContextError``, before any wait. At most
# ``max_concurrency`` requests are at the server at once; the rest wait in this client's
# queue, where no timeout runs (``timeout_s`` counts from the send). A request that timed
# out is cut (its connection closed: llama.cpp's and vLLM's servers then cancel it,
# queued or running); on a server that works on regardless it may still be running, so
# its retry waits out a longer backoff *holding its slot* (no other request of this model
# joins the server's queue meanwhile; the retry itself may still wait there behind the cut
# request). The timeout says how long the request waited in the queue and how long at
# the server. A server's refusal teaches the model the server's count and
# window; one that refused only the reply's size (vLLM) is asked once more for less.

SEND_HOLD_S = 600.0  # a call held by ``UsageMeter.stop_sending`` raises after this long
# The answer's share of a cut call's upper bound when the request sets no max_tokens (and
# the client sends none by default): OpenAI's gpt-4o and gpt-4o-mini answer at most this
# many tokens. A model that may answer more should say so (``max_answer_tokens``).
DEFAULT_MAX_ANSWER_TOKENS = 16_384
_ANSWER_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

# NOTE [One meter]
# Every model call goes through ``_attempt``, and every meter that counts it (the
# model's own, and each enclosing ``track_usage`` block's: a job's, a remote task's on a
# worker) counts it there, at the moment it is sent and at the moment it ends:
#
# - sent: ``call_sent`` (the meter's ``in_flight``), unless a meter said
#   ``stop_sending`` (a job past its cost cap): then the call is not sent, and waits
#   until its caller is cancelled;
# - answered: ``record_completion`` with the usage the server reported, before any
#   other await (a cancellation after the answer came cannot lose it);
# - cut (cancelled, interrupted, timed out, connection lost after it was sent, an
#   answer that cannot be read): the provider may have billed it, and the client can
#   no longer know for how much, so ``record_cut`` counts an upper bound: the request's
#   tokens as the rate limiter counts them (``estimate_prompt_tokens``) at the input
#   rate, plus its ``max_tokens`` (or the client's default, or ``max_answer_tokens``)
#   at the output rate, and ``Usage.cut`` marks the totals as an upper bound. A status
#   error (4xx, 5xx, 429) is not billed, nor a connection that never opened.
#
# A job's cap waits for ``in_flight`` to reach 0 before it stops the job (``jobs._spending``),
# so a call it let go is answered and counted exactly; a worker reports what the calls
# of a cancelled remote task spent, cut ones included, in its reply to the cancel.


class BaseChatModel(ABC):
    """A ``ChatModel`` with response cache, rate limit, retries and usage totals built in.

    ``await model.complete(messages, **params)`` does, in order:

    1. with a ``cache`` configured (and ``cache=`` not ``False`` for this call): return the
       stored answer for the same request, marked ``cached=True``. The key is the sha256
       of ``cache_request(messages, params)``: the full request as sent (endpoint, model,
       messages, the per-call params *and* the client's defaults);
    2. for each attempt: book a slot with the ``rate_limit`` (waiting for it), then call
       the model once;
    3. on a retryable ``ModelError`` (408, 429, 5xx, connection lost, timeout) wait as the
       ``retry`` policy says (Retry-After honoured) and try again, up to
       ``retry.max_attempts``; then raise ``ModelRetryError`` chaining the last error;
    4. correct the token booking with the usage the server reported (when it reported
       none, the estimate stands), and store the answer in the cache.

    Every attempt sent is counted in ``usage`` (a ``UsageMeter``; ``usage.snapshot()``
    reads it) and in the enclosing ``track_usage`` blocks, as it is sent and as it ends:
    answered, with the usage the server reported; cut before its answer (cancelled,
    timed out, connection lost), at an upper bound (``Usage.cut``; NOTE [One meter]).

    Inside a task run by a fleet's worker, each call is also kept in the task's call
    journal before it returns, and a rerun of the task (its worker died before the
    reply) replays it instead of calling the model again, whatever ``cache`` says:
    counted in ``usage`` with its tokens and cost, and as ``replayed`` (see NOTE [Call
    journal] in ``asyncgraph.models._journal``).

    ``cache=True`` for a call with no cache configured raises ``ValueError``.
    ``cache_if=predicate`` lets the caller say which answers are usable: a cached answer it
    rejects is deleted and the model is asked again, a fresh answer it rejects is returned
    but not stored (so an unusable reply is never replayed). A failing cache backend is
    logged (logger ``asyncgraph.models``) and treated as a miss: the cache never costs you
    an answer. ``aclose()`` (or ``async with``) releases the HTTP and Redis connections.

    In a process where a worker serves, a call's params first pass the one outbound
    policy (see NOTE [Outbound policy] in ``asyncgraph.models._outbound``): an
    ``api_base`` / ``base_url`` param must be a base URL the operator allows, a
    credential or header param (``api_key``, ``headers``, ``extra_headers``, ...) is
    refused, and any other name must be one the client declares in ``request_params``;
    a refused param raises ``ModelConfigError`` naming it, and nothing is sent.

    Limits (see NOTE [Requests a server can serve]): ``context_tokens`` (the window a
    request must fit), ``max_concurrency`` (requests at the server at once; the rest wait
    in this client's queue) and ``max_tokens`` (the size of every reply that asks for
    none, over the size the asking code suggests) are taken as given, else from the server
    where it says (``_discover``), else from the dated table; ``await model.limits()``
    reads them. ``structured_outputs`` says whether the provider takes
    ``response_format`` (a JSON schema): True for the HTTP clients; set it to False for a
    server that does not, or let an optimizer find out (see ``asyncgraph.optim.TGD``).

    Subclasses implement ``_complete_once(messages, params)``, one attempt that raises a
    ``ModelError`` subclass on failure, and may override ``cache_request`` (whatever they
    add to the request must be in it), ``cache_endpoint``, ``estimate_tokens`` and
    ``_discover``; ``reply_tokens_param`` names the parameter a reply's size is sent as
    (None: the model is not sized). A client that only puts params in the body of a
    request to its own URL declares ``request_params = None``; the default (the chat
    completion params) is the strict rule for a client that hands params to a library.
    Example::

        class Echo(BaseChatModel):
            def __init__(self, **options):
                super().__init__("echo", **options)

            async def _complete_once(self, messages, params):
                return Completion(messages[-1]["content"], model="echo")
    """

    # The call params a task may give this client, besides the destinations the operator
    # allows (None: any; see NOTE [Outbound policy]).
    request_params: ClassVar[frozenset[str] | None] = CHAT_PARAMS

    max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS
    """The longest answer this model gives when a request sets no ``max_tokens``: the
    answer's share of a cut call's upper bound (NOTE [One meter])."""

    def __init__(
        self,
        name: str,
        *,
        retry: Retry | None = None,
        rate_limit: RateLimit | RateLimiter | None = None,
        cache: Cache | None = None,
        pricing: Pricing | None = None,
        usage: UsageMeter | None = None,
        max_tokens: int | None = None,
        max_concurrency: int | None = None,
        context_tokens: int | None = None,
    ) -> None:
        _check_options(type(self).__name__, retry, rate_limit, cache, pricing, usage)
        self._set_limits(max_tokens, max_concurrency, context_tokens)
        self.estimator = TokenEstimator()
        self._server_limits: tuple[int | None, int | None] = (None, None)
        self._discovery_tries = 0
        self._limits_lock = threading.Lock()
        self._per_loop: weakref.WeakKeyDictionary[object, _LoopState] = weakref.WeakKeyDictionary()
        self.name = name
        self.retry = retry if retry is not None else Retry()
        self.rate_limiter = (
            make_rate_limiter(rate_limit, default_name=name) if rate_limit is not None else None
        )
        self.cache = cache
        self.pricing = pricing
        self.usage = usage if usage is not None else UsageMeter()

    structured_outputs: bool = False
    """Whether the provider takes ``response_format`` with a JSON schema (an instance may
    set it: False for a server that refuses it)."""

    reply_tokens_param: str | None = None
    """The request parameter a reply's size is sent as (None: this model is not sized)."""

    warm_cache: bool | None = None
    """Whether a step's requests that share a cacheable prefix wait for the first of them
    (NOTE [Cache warming] in ``asyncgraph.models._warming``): None, the default, where the
    provider caches prefixes (Anthropic, OpenAI's own API, Azure); False turns it off."""

    def _cache_prefix(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> str | None:
        """The key of the prefix of a request its provider may cache (None: none; the
        default). See NOTE [Cache warming]."""
        return None

    def _warming(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> Any:
        """Around one call: wait for the first request of its cacheable prefix, if any."""
        key = self._cache_prefix(messages, params) if self.warm_cache is not False else None
        state = self._loop_state()
        wait_s = float(getattr(self, "timeout_s", 60.0))
        return state.warming.request(key, wait_s)

    @property
    def cache_endpoint(self) -> str:
        """Where requests go, part of the cache key (the same request elsewhere is another)."""
        return self.name

    def missing_api_keys(self) -> list[str]:
        """The environment variables holding an API key that this model needs and that
        are not set (``[]``: none). A client that reads its key when built refuses to be
        built without it, so this is for clients whose library reads it at the call
        (LiteLLM's): a command checks it before a run's first call."""
        return []

    # -- limits (NOTE [Requests a server can serve]) ---------------------------------------
    async def _discover(self) -> tuple[int | None, int | None]:
        """``(context_tokens, max_concurrency)`` as the server says them (None: it does
        not); asked once, before the first request. Raises ``ModelError`` when the server
        cannot be reached (asked again at the next request, up to three times)."""
        return None, None

    def _set_limits(
        self, max_tokens: int | None, max_concurrency: int | None, context_tokens: int | None
    ) -> None:
        """Check and keep the limits a user gave (``ValueError`` for one that is not an int
        >= 1 or None)."""
        for option, value in (
            ("max_tokens", max_tokens),
            ("max_concurrency", max_concurrency),
            ("context_tokens", context_tokens),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"{type(self).__name__}: {option}= must be an int >= 1 or None, got {value!r}"
                )
        self.max_tokens = max_tokens
        self.max_concurrency = max_concurrency
        self.context_tokens = context_tokens

    def _table_context_tokens(self) -> int | None:
        """The context window the dated table gives this model, or None."""
        return None

    async def limits(self) -> ModelLimits:
        """This model's limits: those given, else the server's, else the table's (the
        server is asked once, at the first call). See NOTE [Requests a server can serve].

        Example::

            limits = await model.limits()
            print(limits.context_tokens, limits.max_concurrency, limits.source)
        """
        if self._discovery_tries < _DISCOVERY_TRIES and (
            self.context_tokens is None or self.max_concurrency is None
        ):
            async with self._loop_state().discovery:
                if self._discovery_tries < _DISCOVERY_TRIES:
                    try:
                        self._server_limits = await self._discover()
                        self._discovery_tries = _DISCOVERY_TRIES
                    except ModelError:
                        self._discovery_tries += 1
                        logger.debug("%s: could not read the server's limits", self.name)
        server_context, server_slots = self._server_limits
        context, source = self.context_tokens, "given"
        if context is None and server_context is not None:
            context, source = server_context, "server"
        if context is None:
            context, source = self._table_context_tokens(), "table"
        return ModelLimits(
            context_tokens=context,
            max_concurrency=self.max_concurrency or server_slots,
            max_tokens=self.max_tokens,
            chars_per_token=self.estimator.chars_per_token,
            source=source if context is not None else "",
        )

    def _loop_state(self) -> _LoopState:
        """What this model keeps per running event loop (anyio primitives belong to one)."""
        loop = anyio.lowlevel.current_token().native_token
        with self._limits_lock:
            state = self._per_loop.get(loop)
            if state is None:
                state = self._per_loop[loop] = _LoopState()
            return state

    async def _sized(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> dict[str, Any]:
        """``params`` with the reply's size (see NOTE [Requests a server can serve]);
        ``ModelContextError`` when the window leaves no room for a reply."""
        name = self.reply_tokens_param
        if name is None:
            return params
        limits = await self.limits()
        defaults: Mapping[str, Any] = getattr(self, "default_params", None) or {}
        given = next((k for k in _REPLY_PARAMS if k in params), None)
        default = next((k for k in _REPLY_PARAMS if k in defaults), None)
        key: str = given or default or name
        value: Any = params[given] if given else defaults[default] if default else None
        if value is None:
            key, value = (
                name,
                limits.max_tokens or self._suggested_reply_tokens(params, limits.context_tokens),
            )
        context = limits.context_tokens
        if context is not None:
            prompt = self.estimator.count(messages)
            room = context - prompt
            if room < MIN_REPLY_TOKENS:
                raise self._no_room(messages, prompt, limits)
            if isinstance(value, int) and value > room:
                value = room
        if value is None or params.get(key) == value or (not given and value == defaults.get(key)):
            return params
        rest = {k: v for k, v in params.items() if k not in _REPLY_PARAMS}
        return {**rest, key: value}

    def _suggested_reply_tokens(
        self, params: Mapping[str, Any], context_tokens: int | None = None
    ) -> int | None:
        """The reply size suggested for this request (``reply_tokens``), or None where a
        suggestion would cut a model's thinking short (a ``thinking`` param: its budget
        must fit inside ``max_tokens``)."""
        defaults: Mapping[str, Any] = getattr(self, "default_params", None) or {}
        if "thinking" in params or "thinking" in defaults:
            return None
        return current_reply_tokens(context_tokens)

    def _no_room(
        self, messages: list[dict[str, Any]], prompt: int, limits: ModelLimits
    ) -> ModelContextError:
        sizes = [self.estimator.tokens(str(m.get("content", ""))) for m in messages]
        longest = max(range(len(messages)), key=lambda i: sizes[i])
        where = {"given": "context_tokens=", "server": "the server", "table": "the table"}
        return ModelContextError(
            f"{self.name!r}: a request of about {prompt:,} tokens does not fit the context "
            f"window of {limits.context_tokens:,} tokens (from {where[limits.source]}) with "
            f"room for a reply of at least {MIN_REPLY_TOKENS}: messages[{longest}] "
            f"({messages[longest].get('role')}) is the longest, about {sizes[longest]:,} "
            "tokens. Send less (a shorter prompt or input, a smaller feedback budget), or "
            "set context_tokens= on the model if its window is larger; nothing was sent",
            model=self.name,
            prompt_tokens=prompt,
            context_tokens=limits.context_tokens,
            reply_tokens=MIN_REPLY_TOKENS,
        )

    def _learn_refusal(self, messages: list[dict[str, Any]], exc: ModelContextError) -> None:
        """What a server's context refusal says: its exact count of the request (for the
        estimator), and its window, when this model has not been given one."""
        if exc.prompt_tokens is not None:
            self.estimator.exact(
                chars=request_chars(messages),
                messages=len(messages),
                prompt_tokens=exc.prompt_tokens,
            )
        known, slots = self._server_limits
        if exc.context_tokens is not None and (known is None or exc.context_tokens < known):
            self._server_limits = (exc.context_tokens, slots)

    def _reply_that_fits(
        self, params: dict[str, Any], exc: ModelContextError
    ) -> dict[str, Any] | None:
        """``params`` asking for the reply the server says is left, when the prompt fits
        and only its reply did not (vLLM's refusal); else None."""
        key = _reply_param(params)
        if key is None or exc.prompt_tokens is None or exc.context_tokens is None:
            return None
        room = exc.context_tokens - exc.prompt_tokens - 8
        if room < MIN_REPLY_TOKENS or room >= params[key]:
            return None
        return {**params, key: room}

    @asynccontextmanager
    async def _server_slot(self, limit: int | None) -> AsyncIterator[float]:
        """One of ``limit`` places at the server (none to wait for without a limit); yields
        the seconds waited for it in this client's queue."""
        if limit is None:
            yield 0.0
            return
        state = self._loop_state()
        if state.slots is None or state.slots_limit != limit:
            state.slots, state.slots_limit = anyio.Semaphore(limit), limit
        slots = state.slots
        started = time.perf_counter()
        async with slots:
            yield time.perf_counter() - started

    def _record_usage(self, record: Callable[..., None], *args: Any) -> None:
        """Record on this model's meter and on every enclosing ``track_usage`` meter (by
        name: a meter's subclass may extend the method, e.g. to check a cost cap)."""
        for meter in meters_for(self.usage):
            getattr(meter, record.__name__)(*args)

    def cache_request(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The request as it will be sent, as JSON data: what the cache key hashes.

        Everything that can change the answer must be in it, or two different requests
        would share one cached answer. The default is ``{"endpoint": cache_endpoint,
        "model": name, "messages": messages, "params": params}`` (``request_key``'s
        fields); a client that adds to the request (default params, reply options)
        overrides it to return what it really sends.
        """
        return {
            "endpoint": self.cache_endpoint,
            "model": self.name,
            "messages": messages,
            "params": dict(params),
        }

    def estimate_tokens(self, messages: Sequence[Message], params: Mapping[str, Any]) -> int:
        """Tokens a request will use, booked in a tokens-per-minute budget before the call.

        About 4 characters per token for the prompt (``estimate_prompt_tokens``), plus
        ``max_tokens`` (or ``max_completion_tokens``, default 256) for the answer. The
        booking is corrected with the server's reported usage afterwards.
        """
        answer = params.get("max_tokens", params.get("max_completion_tokens", 256))
        prompt = self.estimate_prompt_tokens(messages)
        return prompt + (answer if isinstance(answer, int) else 256)

    def estimate_prompt_tokens(self, messages: Sequence[Message]) -> int:
        """The prompt's tokens, about 4 characters per token plus 4 per message."""
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        return chars // 4 + 4 * len(messages)

    def cut_bound(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> tuple[int, int]:
        """What a call cut before its answer is counted at (NOTE [One meter]): at most the
        prompt's tokens, and the longest answer the request allows: the ``max_tokens`` (or
        ``max_completion_tokens``) it sends, the client's default included (what
        ``cache_request`` says is sent), else ``max_answer_tokens``.

        The prompt is bounded by the UTF-8 bytes of the whole request as described (its
        messages, tools and other params; a byte-level BPE token is at least one byte)
        plus a chat template's few tokens per message: never below what a server counts,
        where the 4-characters-a-token estimate undercounts CJK text and leaves out tool
        schemas."""
        try:
            request = self.cache_request(messages, params)
        except Exception:  # a client whose request cannot be described: the call's params
            request = {"params": dict(params)}
        sent = request.get("body", request.get("params"))
        limits = [sent.get(k) for k in _ANSWER_LIMITS] if isinstance(sent, Mapping) else []
        answer = next(
            (n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0),
            self.max_answer_tokens,
        )
        described = json.dumps(request, default=str, ensure_ascii=False).encode()
        return len(described) + 8 * len(messages), answer

    def _maybe_billed(self, error: ModelError) -> bool:
        """Whether an attempt that raised ``error`` may have been billed: not when the
        server answered with an error status (providers bill answers, not refusals)."""
        return not isinstance(error, ModelStatusError)

    async def _prepare(self) -> None:
        """Set up what an attempt needs (connections, clients); runs before the rate limit."""
        return None

    @abstractmethod
    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        """One attempt; raise a ``ModelError`` subclass (retryable or not) on failure."""

    async def _attempt(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> Completion:
        """One attempt (``_complete_once``), counted by every meter of this call as it is
        sent, answered or cut (NOTE [One meter])."""
        meters = meters_for(self.usage)
        await self._wait_to_send(meters)
        for meter in meters:
            meter.call_sent()
        try:
            completion = await self._complete_once(messages, params)
        except ModelError as exc:
            if self._maybe_billed(exc):
                self._record_cut(meters, messages, params)
            raise
        except BaseException:  # cancelled or interrupted: the request may be on the server
            self._record_cut(meters, messages, params)
            raise
        else:
            for meter in meters:
                meter.record_completion(completion, self.pricing)
            return completion
        finally:
            for meter in meters:
                meter.call_ended()

    def _record_cut(
        self,
        meters: Sequence[UsageMeter],
        messages: list[dict[str, Any]],
        params: dict[str, Any],
    ) -> None:
        prompt, answer = self.cut_bound(messages, params)
        for meter in meters:
            meter.record_cut(prompt, answer, self.pricing)

    async def _wait_to_send(self, meters: Sequence[UsageMeter]) -> None:
        """Return at once, unless a meter of this call stopped sending: then wait for the
        caller's cancellation, at most ``SEND_HOLD_S`` (then raise ``ModelError``)."""
        reason = next((m.sending_stopped for m in meters if m.sending_stopped), None)
        if reason is None:
            return
        with anyio.move_on_after(SEND_HOLD_S):
            await anyio.sleep_forever()
        raise ModelError(
            f"{self.name!r}: the call was not sent: {reason}, and its caller was not "
            f"cancelled within {SEND_HOLD_S:g}s",
            model=self.name,
        )

    async def complete(
        self,
        messages: Sequence[Message],
        *,
        cache: bool | None = None,
        cache_if: Callable[[Completion], bool] | None = None,
        **params: Any,
    ) -> Completion:
        """Answer ``messages``; see the class docstring for the middleware order.

        ``cache``: ``None`` uses the configured cache if any, ``False`` bypasses it for this
        call (no read, no write), ``True`` requires one. ``cache_if(completion) -> bool``
        (must not raise): only answers it accepts are served from or stored in the cache.
        Other keyword arguments are sent to the model (``temperature=0``,
        ``max_tokens=200``, ...). Raises ``ModelError`` subclasses (``ModelConfigError``
        for a param the outbound policy refuses), ``TypeError`` / ``ValueError`` for
        malformed messages or params.
        """
        msgs = normalize_messages(messages)
        reserved = _RESERVED_PARAMS.intersection(params)
        if reserved:
            raise ValueError(
                f"{self.name!r}: params {sorted(reserved)} are set by the client and cannot be "
                "passed to complete() (streaming is not supported)"
            )
        # Before the cache, the journal and any send: see NOTE [Outbound policy].
        check_call_params(self.name, type(self).__name__, type(self).request_params, params)
        if cache and self.cache is None:
            raise ValueError(
                f"complete(cache=True) on {self.name!r}, which has no cache: construct it with "
                "cache=MemoryCache() / DiskCache(dir) / RedisCache(url)"
            )
        params = await self._sized(msgs, params)
        store = self.cache if cache is not False else None
        observed = observing_calls()
        started = (time.perf_counter(), time.time()) if observed else (0.0, 0.0)
        key = ""
        if store is not None:
            key = digest_request(self.cache_request(msgs, params))
            hit = await self._cache_get(store, key)
            if hit is not None:
                if cache_if is None or cache_if(hit):
                    self._record_usage(UsageMeter.record_cache_hit)
                    answer = replace(hit, cached=True)
                    if observed:
                        self._notify(msgs, params, started, 0, answer, None)
                    return answer
                # Replaying an answer the caller cannot use would fail the same way forever.
                await self._cache_delete(store, key)
        journal, call = self._journal_call(msgs, params, key)
        replayed = await self._replay(journal, call, msgs, params, started if observed else None)
        if replayed is not None:
            return replayed
        attempts = [0]
        retried_after: list[str] = []
        try:
            async with (
                self._warming(msgs, params),  # see NOTE [Cache warming]
                call_slot(),  # bounded when the caller asked (limit_calls)
            ):
                completion = await self._complete_with_retries(
                    msgs, params, attempts, retried_after
                )
        except Exception as exc:
            self._record_usage(UsageMeter.record_error)
            if observed:
                self._notify(msgs, params, started, attempts[0], None, exc, retried_after)
            raise
        # Counted already (``_attempt``). Kept before the answer leaves: a worker that
        # dies from here on costs no new call.
        await self._journal_record(journal, call, completion)
        if observed:
            self._notify(msgs, params, started, attempts[0], completion, None, retried_after)
        if store is not None and (cache_if is None or cache_if(completion)):
            await self._cache_set(store, key, completion)
        return completion

    def _journal_call(
        self, messages: list[dict[str, Any]], params: dict[str, Any], digest: str
    ) -> tuple[CallJournal | None, str]:
        """The current remote task's call journal and this call's name in it (None
        outside a fleet's task, or for a request that cannot be hashed)."""
        journal = current_journal()
        if journal is None:
            return None, ""
        if not digest:
            try:
                digest = digest_request(self.cache_request(messages, params))
            except TypeError:  # params that are not JSON: such a call is not journaled
                return None, ""
        return journal, journal.name(digest)

    async def _replay(
        self,
        journal: CallJournal | None,
        call: str,
        messages: list[dict[str, Any]],
        params: dict[str, Any],
        started: tuple[float, float] | None,
    ) -> Completion | None:
        """The answer an earlier delivery of this task recorded for ``call``, counted as
        replayed (and told to observers when ``started``); None if there is none."""
        replayed = None if journal is None else await journal.replay(call)
        if replayed is not None:
            self._record_usage(UsageMeter.record_replay, replayed, self.pricing)
            if started is not None:
                self._notify(messages, params, started, 0, replayed, None)
        return replayed

    async def _journal_record(
        self, journal: CallJournal | None, call: str, completion: Completion
    ) -> None:
        if journal is not None:
            await journal.record(call, completion)

    def _notify(
        self,
        messages: list[dict[str, Any]],
        params: dict[str, Any],
        started: tuple[float, float],
        attempts: int,
        completion: Completion | None,
        error: BaseException | None,
        retried_after: Sequence[str] = (),
    ) -> None:
        """Tell the ``observe_calls`` observers about one call (see ``ModelCall``)."""
        try:
            request = self.cache_request(messages, params)
        except Exception:  # a client whose request cannot be described: log what we have
            request = {"model": self.name, "messages": messages, "params": params}
        cost: float | None = None
        if completion is not None and self.pricing is not None:
            cost = 0.0 if completion.cached else self.pricing.completion_cost_usd(completion)
        notify_call(
            ModelCall(
                model=self.name,
                endpoint=redact_url(self.cache_endpoint),
                request=request,
                reply=None if completion is None else completion.text,
                prompt_tokens=0 if completion is None else completion.prompt_tokens,
                completion_tokens=0 if completion is None else completion.completion_tokens,
                cost_usd=cost,
                started_s=started[0],
                started_at=started[1],
                latency_s=time.perf_counter() - started[0],
                cached=completion is not None and completion.cached,
                attempts=attempts,
                finish_reason=None if completion is None else completion.finish_reason,
                error=None if error is None else redact(f"{type(error).__name__}: {error}"),
                cache_read_tokens=0 if completion is None else completion.cache_read_tokens,
                cache_write_tokens=0 if completion is None else completion.cache_write_tokens,
                retried_after=tuple(retried_after),
            )
        )

    async def _complete_with_retries(
        self,
        messages: list[dict[str, Any]],
        params: dict[str, Any],
        attempts: list[int] | None = None,
        retried_after: list[str] | None = None,
    ) -> Completion:
        """The attempts of one call (step 2 and 3); ``attempts[0]`` counts them as they go,
        ``retried_after`` gets the error type of each attempt that failed and was retried."""
        limiter = self.rate_limiter
        tokens = self.estimate_tokens(messages, params) if limiter is not None else 0
        slots = (await self.limits()).max_concurrency
        attempt = 0
        while True:
            attempt += 1
            if attempts is not None:
                attempts[0] = attempt
            # Whatever is slow to set up happens before the slot, not between the slot and
            # the send: lateness after the slot eats into the rate limit's margin.
            await self._prepare()
            if limiter is not None:
                await limiter.acquire(tokens)
            try:
                completion = await self._in_slot(messages, params, attempt, slots)
            except ModelError as exc:
                if not exc.retryable:
                    raise
                if attempt >= self.retry.max_attempts:
                    if attempt == 1:
                        raise
                    raise ModelRetryError(
                        f"{self.name!r}: gave up after {attempt} attempts; last error: "
                        f"{type(exc).__name__}: {exc}",
                        model=self.name,
                        attempts=attempt,
                        last_error=exc,
                    ) from exc
                delay = self.retry.backoff_s(attempt, getattr(exc, "retry_after_s", None))
                logger.info(
                    "%s: attempt %d failed (%s: %s); retrying in %.2fs",
                    self.name,
                    attempt,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                self._record_usage(UsageMeter.record_retry)
                if retried_after is not None:
                    retried_after.append(type(exc).__name__)
                if not getattr(exc, "backoff_done", False):  # a timeout waited in its slot
                    await anyio.sleep(delay)
                continue
            # A server that reports no usage leaves the estimate booked: settling with 0
            # would refund the whole booking and switch the tokens-per-minute limit off.
            if limiter is not None and completion.total_tokens > 0:
                try:
                    await limiter.settle(tokens, completion.total_tokens)
                except ModelBackendError:
                    # The slot is used already; losing the paid answer over a budget
                    # correction would be worse than a slightly off token budget.
                    logger.warning("%s: token budget correction failed", self.name, exc_info=True)
            return completion

    async def _in_slot(
        self,
        messages: list[dict[str, Any]],
        params: dict[str, Any],
        attempt: int,
        slots: int | None,
    ) -> Completion:
        """One attempt in one of the server's ``slots`` (see NOTE [Requests a server can
        serve]). A timeout says where its time went, and when a retry follows, its backoff
        is waited out here, in the slot (the error's ``backoff_done`` says so)."""
        async with self._server_slot(slots) as queued_s:
            sent = time.perf_counter()
            try:
                completion = await self._attempt(messages, params)
            except ModelTimeoutError as exc:
                if slots is None:
                    where = (
                        "it was sent at once (no max_concurrency: any wait was in the "
                        f"server's queue) and got no answer in {time.perf_counter() - sent:.1f}s"
                    )
                else:
                    where = (
                        f"it waited {queued_s:.1f}s in this client's queue for one of "
                        f"max_concurrency={slots} slots, then "
                        f"{time.perf_counter() - sent:.1f}s at the server"
                    )
                error = ModelTimeoutError(f"{exc}; {where}", model=exc.model or self.name)
                if attempt < self.retry.max_attempts:
                    # The server may still be working on it: the retry does not join a
                    # queue this request is still in.
                    await anyio.sleep(self.retry.backoff_s(attempt, timed_out=True))
                    error.backoff_done = True
                raise error from exc
            except ModelContextError as exc:
                self._learn_refusal(messages, exc)
                smaller = self._reply_that_fits(params, exc)
                if smaller is None:
                    raise
                # The prompt fits, its reply did not: sent again, once, asking for less.
                completion = await self._attempt(messages, smaller)
        if completion.prompt_tokens > 0:  # the server's count teaches the estimator
            self.estimator.observe(
                chars=request_chars(messages),
                messages=len(messages),
                prompt_tokens=completion.prompt_tokens,
            )
        return completion

    async def _cache_get(self, store: Cache, key: str) -> Completion | None:
        try:
            return await store.get(key)
        except ModelBackendError:
            logger.warning("%s: cache read failed; treating as a miss", self.name, exc_info=True)
            return None

    async def _cache_set(self, store: Cache, key: str, completion: Completion) -> None:
        try:
            await store.set(key, completion)
        except ModelBackendError:
            logger.warning("%s: cache write failed; answer not cached", self.name, exc_info=True)

    async def _cache_delete(self, store: Cache, key: str) -> None:
        try:
            await store.delete(key)
        except ModelBackendError:
            logger.warning("%s: cache delete failed", self.name, exc_info=True)

    async def aclose(self) -> None:
        """Release connections (HTTP, Redis). Shared limiters and caches stay usable."""
        with anyio.CancelScope(shield=True):
            if self.rate_limiter is not None:
                await self.rate_limiter.aclose()
            if self.cache is not None:
                await self.cache.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _reply_param(params: Mapping[str, Any]) -> str | None:
    return next((k for k in _REPLY_PARAMS if isinstance(params.get(k), int)), None)


class _LoopState:
    """A model's anyio primitives for one event loop: the server slots and the lock that
    makes the server's limits be asked once."""

    def __init__(self) -> None:
        self.discovery = anyio.Lock()
        self.warming = Warming()
        self.slots: anyio.Semaphore | None = None
        self.slots_limit: int | None = None


def _check_options(
    model: str, retry: Any, rate_limit: Any, cache: Any, pricing: Any, usage: Any
) -> None:
    """A ``TypeError`` naming the option for a value of the wrong kind, at construction
    (not an ``AttributeError`` at the first call)."""
    checks: list[tuple[str, Any, bool, str]] = [
        ("retry", retry, isinstance(retry, Retry), "an asyncgraph.models.Retry"),
        (
            "rate_limit",
            rate_limit,
            isinstance(rate_limit, (RateLimit, RateLimiter)),
            "an asyncgraph.models.RateLimit or a RateLimiter (acquire/settle/aclose)",
        ),
        (
            "cache",
            cache,
            isinstance(cache, Cache),
            "an asyncgraph.models cache (MemoryCache, DiskCache, RedisCache or any "
            "object with async get/set/delete/aclose)",
        ),
        ("pricing", pricing, isinstance(pricing, Pricing), "an asyncgraph.models.Pricing"),
        ("usage", usage, isinstance(usage, UsageMeter), "an asyncgraph.models.UsageMeter"),
    ]
    for option, value, ok, expected in checks:
        if value is not None and not ok:
            raise TypeError(
                f"{model}: {option}= must be {expected} or None, got "
                f"{type(value).__name__} ({value!r:.60})"
            )
