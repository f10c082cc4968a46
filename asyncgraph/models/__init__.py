"""LLM model clients for asyncgraph.

A model answers chat messages: ``await model.complete(messages, **params)`` returns a
``Completion`` (text, token usage, model name); anything with that method is a
``ChatModel``. The clients shipped here share one middleware stack (``BaseChatModel``):

- retries with exponential backoff and jitter on 429 / 5xx / connection errors /
  timeouts, honouring Retry-After (``Retry``);
- a rate limit in requests and tokens per minute, in-process or shared by every process
  through Redis (``RateLimit``; ``LocalRateLimiter``, ``RedisRateLimiter``);
- a response cache keyed by the sha256 of the request, off by default, switchable per
  call with ``cache=False`` (``MemoryCache``, ``DiskCache``, ``RedisCache``);
- usage and cost totals (``model.usage.snapshot()`` -> ``Usage``; ``Pricing``).

Clients: ``OpenAIChat`` (any OpenAI-compatible chat completions server) and
``SimulatedModel`` (offline and deterministic, labelled simulated in every answer).
``parse_model_spec("openai:gpt-4o-mini")`` / ``parse_model_spec("simulated")`` builds one
from a command-line string. Errors are ``ModelError`` subclasses (see ``_exceptions``).
"""

from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache, DiskCache, MemoryCache, RedisCache, request_key
from asyncgraph.models._exceptions import (
    ModelBackendError,
    ModelConnectionError,
    ModelError,
    ModelRateLimitedError,
    ModelRequestError,
    ModelResponseError,
    ModelRetryError,
    ModelServerError,
    ModelStatusError,
    ModelTimeoutError,
    RateLimitWaitError,
)
from asyncgraph.models._openai import DEFAULT_BASE_URL, OpenAIChat
from asyncgraph.models._ratelimit import (
    LocalRateLimiter,
    RateLimit,
    RateLimiter,
    RedisRateLimiter,
)
from asyncgraph.models._retry import Retry
from asyncgraph.models._simulated import (
    SIMULATED_MODEL_NAME,
    SIMULATED_TAG,
    SimulatedModel,
    simulated_reply,
)
from asyncgraph.models._spec import parse_model_spec
from asyncgraph.models._types import ChatModel, Completion, Message
from asyncgraph.models._usage import Pricing, Usage, UsageMeter

__all__ = [
    "BaseChatModel",
    "Cache",
    "ChatModel",
    "Completion",
    "DEFAULT_BASE_URL",
    "DiskCache",
    "LocalRateLimiter",
    "MemoryCache",
    "Message",
    "ModelBackendError",
    "ModelConnectionError",
    "ModelError",
    "ModelRateLimitedError",
    "ModelRequestError",
    "ModelResponseError",
    "ModelRetryError",
    "ModelServerError",
    "ModelStatusError",
    "ModelTimeoutError",
    "OpenAIChat",
    "Pricing",
    "RateLimit",
    "RateLimitWaitError",
    "RateLimiter",
    "RedisCache",
    "RedisRateLimiter",
    "Retry",
    "SIMULATED_MODEL_NAME",
    "SIMULATED_TAG",
    "SimulatedModel",
    "Usage",
    "UsageMeter",
    "parse_model_spec",
    "request_key",
    "simulated_reply",
]
