"""LLM model clients for asyncgraph.

A model answers chat messages: ``await model.complete(messages, **params)`` returns a
``Completion`` (text, token usage, model name); anything with that method is a
``ChatModel``. The clients shipped here share one middleware stack (``BaseChatModel``):

- retries with exponential backoff and jitter on 408 / 429 / 5xx / connection errors /
  timeouts, honouring Retry-After in seconds or as an HTTP date (``Retry``);
- a rate limit in requests and tokens per minute, in-process or shared by every process
  through Redis (``RateLimit``; ``LocalRateLimiter``, ``RedisRateLimiter``);
- a response cache keyed by the sha256 of the full request as sent (client defaults
  included), off by default, switchable per call with ``cache=False``, and with
  ``cache_if=`` for answers the caller can use (``MemoryCache``, ``DiskCache``,
  ``RedisCache``);
- usage and cost totals (``model.usage.snapshot()`` -> ``Usage``; ``Pricing``; a dated
  price table ``PRICES`` for models built from a spec, ``ASYNCGRAPH_MODEL_PRICES`` to
  override it; an unknown price is reported as unknown, ``format_cost``);
- limits (``context_tokens``, ``max_concurrency``, ``max_tokens``; ``await
  model.limits()`` -> ``ModelLimits``): given, read from the server (llama.cpp,
  vLLM) or from a dated table; every request sized to them (``reply_tokens``, the
  reply size the asking code suggests) and a request beyond the window refused before
  it is sent (``ModelContextError``);
- a record of each call for observers (``observe_calls`` -> ``ModelCall``: request,
  reply, tokens, latency, cached, attempts, cost), which logs and traces build on.

Clients: ``OpenAIChat`` (any OpenAI-compatible chat completions server),
``AnthropicChat`` (Anthropic's native Messages API), ``AzureOpenAIChat`` (an Azure OpenAI
deployment) and ``SimulatedModel`` (offline and deterministic, labelled simulated in
every answer). Usage counts the prompt tokens a provider read from or wrote to its
prompt cache, priced at its cached rates. ``parse_model_spec("openai:gpt-4o-mini")``
(or ``"openai/gpt-4o-mini"``, ``"anthropic:claude-sonnet-4-20250514"``,
``"azure/DEPLOYMENT"``, ``"simulated"``) builds one from a command-line string; such models take their rate limit and cache from the
environment (``ASYNCGRAPH_MODEL_RPM``, ``ASYNCGRAPH_MODEL_TPM``,
``ASYNCGRAPH_MODEL_RATE_REDIS``, ``ASYNCGRAPH_MODEL_CACHE``; see
``model_options_from_env``), which is how a worker fleet shares one rate limit. Errors are
``ModelError`` subclasses: a branch of asyncgraph's one exception tree
(``AsyncGraphError``; drawn in ``asyncgraph._exceptions``).

Secrets: a client's API key, the password and credential query values of its base URL,
and the values of its credential headers (``Authorization``, ``api-key``, ``X-Api-Key``,
any ``*-Token``, cookies) are masked in every output of the process from the moment it
is made, in the forms servers echo them; ``Secret(value)`` marks any other header value
(or a job's config value) as one.
"""

from typing import TYPE_CHECKING

from asyncgraph._exceptions import (
    ModelBackendError,
    ModelConfigError,
    ModelConnectionError,
    ModelContextError,
    ModelError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelRequestTimeoutError,
    ModelResponseError,
    ModelRetryError,
    ModelServerError,
    ModelStatusError,
    ModelTimeoutError,
    RateLimitWaitError,
)
from asyncgraph._lazy import lazy_exports
from asyncgraph._redact import Secret

# Imported for its effect: it installs the task hook that counts a remote task's model
# calls on the worker and adds them to the caller's usage meters.
from asyncgraph.models import _policy  # noqa: F401  # isort: skip

if TYPE_CHECKING:  # loaded on first use (``asyncgraph._lazy``): a provider's client, httpx
    # and ssl load with the first model that needs them, not with asyncgraph.text.
    from asyncgraph.models._anthropic import AnthropicChat
    from asyncgraph.models._azure import AzureOpenAIChat
    from asyncgraph.models._base import BaseChatModel
    from asyncgraph.models._cache import DiskCache, MemoryCache, RedisCache
    from asyncgraph.models._calls import ModelCall, observe_calls
    from asyncgraph.models._calls import limit_calls as limit_calls
    from asyncgraph.models._limits import ModelLimits as ModelLimits
    from asyncgraph.models._limits import reply_tokens as reply_tokens
    from asyncgraph.models._openai import OpenAIChat
    from asyncgraph.models._ratelimit import LocalRateLimiter, RateLimit, RedisRateLimiter
    from asyncgraph.models._retry import Retry
    from asyncgraph.models._simulated import SimulatedModel
    from asyncgraph.models._spec import check_base_url, parse_model_spec
    from asyncgraph.models._types import ChatModel, Completion
    from asyncgraph.models._usage import Pricing, Usage, UsageMeter, format_cost, track_usage

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AnthropicChat": "._anthropic",
        "AzureOpenAIChat": "._azure",
        "BaseChatModel": "._base",
        "DiskCache": "._cache",
        "MemoryCache": "._cache",
        "RedisCache": "._cache",
        "ModelCall": "._calls",
        "observe_calls": "._calls",
        # Not public names: how asyncgraph.optim bounds every model call of a search, how
        # asyncgraph.text suggests a reply's size, and what limits() returns.
        "limit_calls": "._calls",
        "ModelLimits": "._limits",
        "reply_tokens": "._limits",
        "OpenAIChat": "._openai",
        "LocalRateLimiter": "._ratelimit",
        "RateLimit": "._ratelimit",
        "RedisRateLimiter": "._ratelimit",
        "Retry": "._retry",
        "SimulatedModel": "._simulated",
        "check_base_url": "._spec",
        "parse_model_spec": "._spec",
        "ChatModel": "._types",
        "Completion": "._types",
        "Pricing": "._usage",
        "Usage": "._usage",
        "UsageMeter": "._usage",
        "format_cost": "._usage",
        "track_usage": "._usage",
    },
)

__all__ = [
    "AnthropicChat",
    "AzureOpenAIChat",
    "BaseChatModel",
    "ChatModel",
    "Completion",
    "DiskCache",
    "LocalRateLimiter",
    "MemoryCache",
    "ModelBackendError",
    "ModelCall",
    "ModelConfigError",
    "ModelConnectionError",
    "ModelContextError",
    "ModelError",
    "ModelRateLimitedError",
    "ModelRequestError",
    "ModelRequestTimeoutError",
    "ModelResponseError",
    "ModelRetryError",
    "ModelServerError",
    "ModelStatusError",
    "ModelTimeoutError",
    "OpenAIChat",
    "Pricing",
    "RateLimit",
    "RateLimitWaitError",
    "RedisCache",
    "RedisRateLimiter",
    "Retry",
    "Secret",
    "SimulatedModel",
    "Usage",
    "UsageMeter",
    "check_base_url",
    "format_cost",
    "observe_calls",
    "parse_model_spec",
    "track_usage",
]
