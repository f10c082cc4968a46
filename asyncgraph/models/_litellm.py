"""``LiteLLMChat``: every provider LiteLLM knows, called in-process through LiteLLM.

The ``litellm`` extra: this module imports ``litellm`` only when a ``LiteLLMChat`` is
built, so ``asyncgraph.models`` imports without it. Specs ``litellm:MODEL`` /
``litellm/MODEL`` build one, ``MODEL`` in LiteLLM's own form
(``bedrock/anthropic.claude-3-haiku...``, ``gemini/gemini-2.0-flash``,
``groq/llama-3.1-8b-instant``, ``gpt-4o-mini``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import anyio

from asyncgraph._exceptions import (
    ModelConfigError,
    ModelConnectionError,
    ModelError,
    ModelResponseError,
    ModelTimeoutError,
)
from asyncgraph._install import install_hint
from asyncgraph._redact import redact, redact_url, register_secret, secret_values
from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache
from asyncgraph.models._http import status_error_kind
from asyncgraph.models._outbound import CHAT_PARAMS
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter

__all__ = ["LiteLLMChat", "litellm_completion", "litellm_pricing"]

_INSTALL = install_hint("litellm")


def _litellm() -> Any:
    try:
        litellm: Any = importlib.import_module("litellm")
    except ImportError as exc:
        raise ModelConfigError(
            f"LiteLLMChat needs the litellm package, which is not installed: {_INSTALL}",
            variable="litellm",
            value="",
        ) from exc
    # LiteLLM prints a "Give Feedback / Get Help" block to stdout with each exception it
    # raises; asyncgraph reports the error itself (``_model_error``), once.
    litellm.suppress_debug_info = True
    return litellm


def litellm_pricing(litellm: Any, model: str) -> Pricing | None:
    """``model``'s prices from LiteLLM's cost map (input, output, cache-read and
    cache-write per token, as dollars per million), or None when it has none."""
    try:
        info = litellm.get_model_info(model)
    except Exception:  # LiteLLM raises a bare Exception for a model it does not know
        return None

    def per_1m(key: str) -> float | None:
        value = info.get(key)
        return None if value is None else float(value) * 1e6

    given, answered = per_1m("input_cost_per_token"), per_1m("output_cost_per_token")
    if given is None or answered is None:
        return None
    return Pricing(
        given,
        answered,
        cached_input_usd_per_1m=per_1m("cache_read_input_token_cost"),
        cache_write_usd_per_1m=per_1m("cache_creation_input_token_cost"),
    )


def litellm_completion(response: Any, model: str) -> Completion:
    """The ``Completion`` of a LiteLLM ``ModelResponse`` (OpenAI-shaped): its first
    choice's text and finish reason, and its usage, cached prompt tokens included
    (``prompt_tokens_details.cached_tokens``, or Anthropic's ``cache_read_input_tokens``
    / ``cache_creation_input_tokens`` that LiteLLM keeps). Raises ``KeyError`` /
    ``TypeError`` / ``AttributeError`` / ``IndexError`` for anything else."""
    choice = response.choices[0]
    usage = getattr(response, "usage", None)

    def count(owner: Any, name: str) -> int:
        value = getattr(owner, name, None) if owner is not None else None
        return int(value) if isinstance(value, int) else 0

    details = getattr(usage, "prompt_tokens_details", None)
    read = count(details, "cached_tokens") or count(usage, "cache_read_input_tokens")
    return Completion(
        text=choice.message.content or "",
        model=str(getattr(response, "model", None) or model),
        prompt_tokens=count(usage, "prompt_tokens"),
        completion_tokens=count(usage, "completion_tokens"),
        finish_reason=getattr(choice, "finish_reason", None),
        cache_read_tokens=read,
        cache_write_tokens=count(usage, "cache_creation_input_tokens"),
    )


def _model_error(exc: Exception, model: str, litellm: Any, secrets: list[str]) -> ModelError:
    """The asyncgraph error for an exception LiteLLM raised (LiteLLM's exceptions carry
    the provider's HTTP status as ``status_code``), ``secrets`` masked."""
    text = redact(f"{type(exc).__name__}: {exc}", [*secrets, *secret_values()])
    status = getattr(exc, "status_code", None)
    message = f"{model!r} via LiteLLM: {text}"
    if isinstance(exc, litellm.Timeout):
        return ModelTimeoutError(message, model=model)
    if isinstance(exc, litellm.APIConnectionError) or not isinstance(status, int):
        return ModelConnectionError(message, model=model)
    kind, _ = status_error_kind(status)
    return kind(message, model=model, status_code=status, server_message=text)


class LiteLLMChat(BaseChatModel):
    """A model of any provider LiteLLM supports, called in-process: its synchronous
    ``completion`` in a worker thread, on every event loop (its async client runs on
    asyncio only). A cancelled call waits for the thread, at most ``timeout_s``: nothing
    keeps running after the caller is cancelled; concurrent calls share anyio's thread
    limiter (40 threads unless the application sets it).

    ``model`` is LiteLLM's model name (``"gemini/gemini-2.0-flash"``); ``base_url`` and
    ``api_key`` are passed as LiteLLM's ``api_base`` / ``api_key`` when given (otherwise
    LiteLLM reads the provider's own environment variables); ``default_params`` are sent
    with every call, under the per-call params (e.g. ``{"mock_response": "hi"}`` for an
    offline test: LiteLLM then answers without the network). LiteLLM's own retries are
    off (``num_retries=0``): ``BaseChatModel``'s retries, rate limit, cache and usage
    apply as for every model, and each attempt must end within ``timeout_s``. The usage
    is LiteLLM's (cached prompt tokens included); the cost uses ``pricing`` or, when
    none is given, the model's rates in LiteLLM's cost map (``litellm_pricing``),
    the rates LiteLLM's own ``completion_cost`` applies. LiteLLM's exceptions become
    ``ModelError`` subclasses by their HTTP status (429 rate limited and 5xx retried,
    other 4xx not). Raises ``ModelConfigError`` when litellm is not installed.

    On a worker, a call's params pass the outbound policy (NOTE [Outbound policy]):
    LiteLLM reads any keyword as it likes (``api_base``, ``api_key``, ``aws_*``,
    ``vertex_*``, ``custom_llm_provider``, logging callbacks...), so a task may give only
    the chat completion params (``request_params``) and an ``api_base`` / ``base_url``
    the operator allows. Example::

        model = LiteLLMChat("gpt-4o-mini", default_params={"mock_response": "Paris"})
        answer = await model.complete([{"role": "user", "content": "Capital of France?"}])
        print(answer.text, model.usage.snapshot().cost_usd)
    """

    # LiteLLM reads every keyword of completion(): only the request's own params, plus
    # top_k (Anthropic's, Gemini's), an offline mock_response and extra_body (JSON body
    # fields), pass in a task.
    request_params = CHAT_PARAMS | {"top_k", "mock_response", "extra_body"}
    # LiteLLM maps both across its providers (response_format as each one takes it; a
    # provider without it refuses, and asyncgraph then asks in the prompt: see
    # asyncgraph.text._structured.ask_json).
    reply_tokens_param: str | None = "max_tokens"
    structured_outputs = True

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        default_params: Mapping[str, Any] | None = None,
        timeout_s: float = 60.0,
        retry: Retry | None = None,
        rate_limit: RateLimit | RateLimiter | None = None,
        cache: Cache | None = None,
        pricing: Pricing | None = None,
        usage: UsageMeter | None = None,
    ) -> None:
        if not model:
            raise ValueError("LiteLLMChat needs a model name, e.g. LiteLLMChat('gpt-4o-mini')")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._litellm = _litellm()
        # LiteLLM's exceptions derive from the openai package's (a dependency of LiteLLM).
        self._errors: tuple[type[Exception], ...] = (importlib.import_module("openai").OpenAIError,)
        if pricing is None:
            pricing = litellm_pricing(self._litellm, model)
        super().__init__(
            model, retry=retry, rate_limit=rate_limit, cache=cache, pricing=pricing, usage=usage
        )
        self.model = model
        self.base_url = base_url
        self._api_key = api_key
        if api_key:
            register_secret(api_key)  # masked in every output of the process from now on
        self.timeout_s = timeout_s
        self.default_params = dict(default_params or {})

    def missing_api_keys(self) -> list[str]:
        """The API-key variables LiteLLM says the model's provider needs and the
        environment lacks (``OPENAI_API_KEY`` for ``gpt-4o-mini``), or ``[]``: none is
        needed when a key, a ``base_url`` or an offline ``mock_response`` is given. Cloud
        credentials (``AWS_*``, ``VERTEXAI_*``) are not counted: a role or profile may
        stand in for them. The model itself is built without a key (as a worker builds it
        from a task): LiteLLM reads it at the call."""
        if self._api_key or self.base_url or "mock_response" in self.default_params:
            return []
        try:
            found = self._litellm.validate_environment(model=self.model)
        except Exception:  # a model LiteLLM cannot place: left to the call's own error
            return []
        missing = found.get("missing_keys") or []
        return [str(name) for name in missing if str(name).endswith("_API_KEY")]

    @property
    def cache_endpoint(self) -> str:
        return f"litellm:{redact_url(self.base_url)}" if self.base_url else "litellm"

    def cache_request(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """What is sent (the key left out), for the cache key."""
        return {
            "endpoint": self.cache_endpoint,
            "model": self.model,
            "messages": messages,
            "params": {**self.default_params, **params},
        }

    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        litellm = self._litellm
        kwargs: dict[str, Any] = {
            **self.default_params,
            **params,
            "model": self.model,
            "messages": messages,
            "num_retries": 0,
            "timeout": self.timeout_s,
        }
        if self.base_url:
            kwargs["api_base"] = self.base_url
        if self._api_key:
            kwargs["api_key"] = self._api_key
        try:
            with anyio.fail_after(self.timeout_s):
                # LiteLLM's async client runs on asyncio only: its synchronous call in a
                # thread serves every event loop with one code path (a thread hop is
                # nothing beside a model call).
                response = await anyio.to_thread.run_sync(
                    lambda: litellm.completion(**kwargs), abandon_on_cancel=False
                )
        except TimeoutError as exc:
            raise ModelTimeoutError(
                f"{self.model!r} via LiteLLM did not answer within {self.timeout_s:g}s",
                model=self.model,
            ) from exc
        except self._errors as exc:
            secrets = [self._api_key] if self._api_key else []
            raise _model_error(exc, self.model, litellm, secrets) from exc
        try:
            return litellm_completion(response, self.model)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
            raise ModelResponseError(
                f"{self.model!r} via LiteLLM: the answer is not a chat completion ({exc!r:.120})",
                model=self.model,
            ) from exc

    def __repr__(self) -> str:
        return f"LiteLLMChat({self.model!r})"
