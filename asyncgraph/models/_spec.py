"""``parse_model_spec``: a model from a command-line string such as ``openai:gpt-4o-mini``.

A spec is ``PROVIDER:MODEL`` or ``PROVIDER/MODEL`` (LiteLLM's and DSPy's form), split at
the first ``:`` or ``/``, so the model keeps its own (``openai/meta-llama/Llama-3-8B``,
``openai:llama3:8b``). Providers: ``simulated`` (offline), ``openai`` (any
OpenAI-compatible server), ``anthropic`` (the native Messages API), ``azure`` (an
Azure OpenAI deployment: ``azure/DEPLOYMENT``) and ``litellm`` (any provider LiteLLM
knows, in-process: ``litellm/gemini/gemini-2.0-flash``; the ``litellm`` extra). A bare well-known name
(``gpt-4o-mini``, ``claude-...``) is refused with the spec to write.

Models built from a spec (by a worker, or by ``asyncgraph.text.resolve_model``) take
their rate limit and response cache from the process environment, so a fleet of workers
is configured without code:

``ASYNCGRAPH_MODEL_RPM`` / ``ASYNCGRAPH_MODEL_TPM``
    requests / tokens per minute allowed for each model name (e.g. ``600`` / ``150000``).
``ASYNCGRAPH_MODEL_RATE_REDIS``
    ``redis://...``: that budget is shared through this Redis by every process that has
    the same settings (one budget for the fleet). Without it the budget is shared by the
    spec-built models of this process only.
``ASYNCGRAPH_MODEL_CACHE``
    ``memory``, ``disk:/some/dir`` or ``redis://...`` (``rediss://``): a response cache,
    shared by the spec-built models of this process (and with ``disk:`` / ``redis://``, by
    every process using the same store). ``off`` or unset: no cache.
``ASYNCGRAPH_MODEL_MAX_ATTEMPTS``
    how many attempts a call gets before it fails (``Retry(max_attempts=N)``; 1 turns
    retries off; default 4). ``asyncgraph run`` / ``demo --max-attempts N`` set it.

**Allowed base URLs.** A worker builds models from specs that arrive in tasks, with its
own API keys (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``, ``AZURE_OPENAI_API_KEY``): a
``base_url`` taken from a task would send a key wherever the task says. So a worker
calls ``restrict_base_urls(urls)`` when it starts: from then on ``parse_model_spec``
(and ``asyncgraph.text.resolve_model``) accept a ``base_url`` only if it is a
provider's default (``https://api.openai.com/v1``, ``https://api.anthropic.com``), one
this process's environment names (``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``,
``AZURE_OPENAI_ENDPOINT``), or one of ``urls`` (``asyncgraph worker --allow-base-url URL``, or
``ASYNCGRAPH_ALLOWED_BASE_URLS``), and raise ``ModelConfigError`` naming the URL and
how to allow it otherwise. The same allow-list decides every call's ``api_base`` /
``base_url`` param and refuses its credential params, for every provider (NOTE
[Outbound policy] in ``asyncgraph.models._outbound``, the one home of that policy). A
process that never calls it (an application) is not restricted.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from asyncgraph._exceptions import ModelConfigError
from asyncgraph._redact import redact_url
from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache, DiskCache, MemoryCache, RedisCache
from asyncgraph.models._outbound import (
    ENV_ALLOWED_BASE_URLS,
    BaseUrlRestriction,
    check_base_url,
    normalize_base_url,
)
from asyncgraph.models._prices import default_pricing
from asyncgraph.models._ratelimit import LocalRateLimiter, RateLimit, RateLimiter
from asyncgraph.models._retry import Retry

__all__ = [
    "ENV_ALLOWED_BASE_URLS",
    "ENV_CACHE",
    "ENV_MAX_ATTEMPTS",
    "ENV_RATE_REDIS",
    "ENV_RPM",
    "ENV_TPM",
    "BaseUrlRestriction",
    "check_base_url",
    "model_options_from_env",
    "normalize_base_url",
    "parse_model_spec",
    "restrict_base_urls",
    "split_model_spec",
]

_FORMS = (
    "'simulated', 'simulated:LATENCY_S', 'openai:MODEL' (any OpenAI-compatible server), "
    "'anthropic:MODEL', 'azure:DEPLOYMENT' or 'litellm:MODEL' (any provider LiteLLM "
    "knows, with the litellm extra), with ':' or '/' after the provider "
    "(e.g. 'openai/gpt-4o-mini', 'anthropic:claude-sonnet-4-20250514')"
)
_PROVIDERS = ("simulated", "openai", "anthropic", "azure", "litellm")
# Bare names a user may write for a provider's model, and the provider they belong to.
_WELL_KNOWN = (
    (("gpt-", "chatgpt-", "o1", "o3", "o4", "text-", "davinci", "babbage"), "openai"),
    (("claude",), "anthropic"),
)

ENV_RPM = "ASYNCGRAPH_MODEL_RPM"
ENV_TPM = "ASYNCGRAPH_MODEL_TPM"
ENV_RATE_REDIS = "ASYNCGRAPH_MODEL_RATE_REDIS"
ENV_CACHE = "ASYNCGRAPH_MODEL_CACHE"
ENV_MAX_ATTEMPTS = "ASYNCGRAPH_MODEL_MAX_ATTEMPTS"

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_CACHE_FORMS = "'memory', 'disk:/path/to/dir', 'redis://host:6379/0' (or rediss://) or 'off'"

# Process-wide on purpose, like the limits they stand for: every spec-built model of one
# name in this process books from one in-process budget, and all share one cache.
_lock = threading.Lock()
_local_limiters: dict[tuple[str, RateLimit], LocalRateLimiter] = {}
_caches: dict[str, Cache] = {}


def _per_minute(environ: Mapping[str, str], variable: str) -> float | None:
    raw = environ.get(variable, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ModelConfigError(
            f"{variable}={raw!r} is not a number > 0: set it to the provider's limit per "
            f"minute (e.g. {variable}=600), or unset it for no limit",
            variable=variable,
            value=raw,
        )
    return value


def _rate_limit(environ: Mapping[str, str], name: str) -> RateLimit | RateLimiter | None:
    rpm = _per_minute(environ, ENV_RPM)
    tpm = _per_minute(environ, ENV_TPM)
    redis_url = environ.get(ENV_RATE_REDIS, "").strip() or None
    if redis_url is not None and not redis_url.startswith(_REDIS_SCHEMES):
        raise ModelConfigError(
            f"{ENV_RATE_REDIS}={redact_url(redis_url)!r} is not a Redis URL: expected "
            "redis://host:6379/0 (or rediss://, unix://)",
            variable=ENV_RATE_REDIS,
            value=redact_url(redis_url),
        )
    if rpm is None and tpm is None:
        if redis_url is not None:
            raise ModelConfigError(
                f"{ENV_RATE_REDIS} is set but neither {ENV_RPM} nor {ENV_TPM} is: set the "
                f"limit to share (e.g. {ENV_RPM}=600), or unset {ENV_RATE_REDIS}",
                variable=ENV_RATE_REDIS,
                value=redis_url,
            )
        return None
    try:
        limit = RateLimit(
            requests_per_minute=rpm, tokens_per_minute=tpm, redis_url=redis_url, name=name
        )
    except ValueError as exc:
        variable = ENV_RPM if rpm is not None else ENV_TPM
        raise ModelConfigError(
            f"{ENV_RPM}={rpm!r} / {ENV_TPM}={tpm!r} do not make a valid rate limit: {exc}",
            variable=variable,
            value=environ.get(variable, ""),
        ) from exc
    if redis_url is not None:
        return limit  # each model gets a RedisRateLimiter on the shared keys of `name`
    with _lock:
        limiter = _local_limiters.get((name, limit))
        if limiter is None:
            limiter = _local_limiters[(name, limit)] = LocalRateLimiter(limit, name=name)
        return limiter


def _cache(environ: Mapping[str, str]) -> Cache | None:
    raw = environ.get(ENV_CACHE, "").strip()
    if raw.lower() in ("", "off", "none"):
        return None
    with _lock:
        cache = _caches.get(raw)
        if cache is not None:
            return cache
        if raw.lower() == "memory":
            cache = MemoryCache()
        elif raw.startswith("disk:") and raw[len("disk:") :].strip():
            cache = DiskCache(os.path.expanduser(raw[len("disk:") :].strip()))
        elif raw.startswith(_REDIS_SCHEMES):
            cache = RedisCache(raw)
        else:
            raise ModelConfigError(
                f"{ENV_CACHE}={raw!r} is not a cache: expected {_CACHE_FORMS}",
                variable=ENV_CACHE,
                value=raw,
            )
        _caches[raw] = cache
        return cache


def _retry(environ: Mapping[str, str]) -> Retry | None:
    raw = environ.get(ENV_MAX_ATTEMPTS, "").strip()
    if not raw:
        return None
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise ModelConfigError(
            f"{ENV_MAX_ATTEMPTS}={raw!r} is not a number of attempts: expected an integer >= 1 "
            f"(1 turns retries off; the default is {Retry().max_attempts})",
            variable=ENV_MAX_ATTEMPTS,
            value=raw,
        )
    return Retry(max_attempts=attempts)


def model_options_from_env(name: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``rate_limit`` / ``cache`` / ``retry`` options the environment sets for ``name``.

    Reads ``ASYNCGRAPH_MODEL_RPM``, ``ASYNCGRAPH_MODEL_TPM``, ``ASYNCGRAPH_MODEL_RATE_REDIS``,
    ``ASYNCGRAPH_MODEL_CACHE`` and ``ASYNCGRAPH_MODEL_MAX_ATTEMPTS`` from ``environ`` (default ``os.environ``; see the module
    docstring). Only the options that are set appear in the result. Raises
    ``ModelConfigError`` (a ``ValueError``) naming the variable when a value is invalid.
    """
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    rate_limit = _rate_limit(env, name)
    if rate_limit is not None:
        options["rate_limit"] = rate_limit
    cache = _cache(env)
    if cache is not None:
        options["cache"] = cache
    retry = _retry(env)
    if retry is not None:
        options["retry"] = retry
    return options


# -- allowed base URLs (a worker's guard for its API key; see NOTE [Outbound policy]) ----


def restrict_base_urls(urls: Iterable[str]) -> BaseUrlRestriction:
    """Allow only these base URLs (plus the providers' defaults and the environment's
    ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and ``AZURE_OPENAI_ENDPOINT``).

    Called by a worker when it starts serving; returns a handle whose ``remove()``
    lifts the restriction (when the worker stops). While several are active (several
    workers in one process), a URL allowed by any of them is allowed. Raises
    ``ValueError`` for a URL that is not ``http(s)://host...``.
    """
    from asyncgraph.models._anthropic import DEFAULT_ANTHROPIC_URL
    from asyncgraph.models._azure import ENV_AZURE_ENDPOINT
    from asyncgraph.models._openai import DEFAULT_BASE_URL

    allowed = {normalize_base_url(DEFAULT_BASE_URL), normalize_base_url(DEFAULT_ANTHROPIC_URL)}
    for variable in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", ENV_AZURE_ENDPOINT):
        own = os.environ.get(variable, "").strip()
        if own:
            allowed.add(normalize_base_url(own))
    allowed.update(normalize_base_url(url) for url in urls)
    return BaseUrlRestriction(frozenset(allowed))


def split_model_spec(spec: str) -> tuple[str, str]:
    """``(provider, model)`` of ``spec``, split at its first ``:`` or ``/`` (provider
    lower-cased, both stripped); ``(spec, "")`` when it has neither."""
    text = spec.strip()
    cuts = [i for i in (text.find(":"), text.find("/")) if i >= 0]
    if not cuts:
        return text.lower(), ""
    cut = min(cuts)
    return text[:cut].strip().lower(), text[cut + 1 :].strip()


def _unknown_spec(spec: str, provider: str, has_model: bool) -> ValueError:
    bare = spec.strip()
    if not has_model:
        for prefixes, owner in _WELL_KNOWN:
            if bare.lower().startswith(prefixes):
                return ValueError(
                    f"model spec {spec!r} names no provider: write '{owner}:{bare}' (or "
                    f"'{owner}/{bare}'); expected {_FORMS}"
                )
    else:
        return ValueError(
            f"bad model spec {spec!r}: {provider!r} is not a provider here (providers: "
            f"{', '.join(_PROVIDERS)}); for a provider LiteLLM knows write 'litellm/{bare}' "
            f"(the litellm extra); for a model an OpenAI-compatible server you run serves "
            f"(vLLM, Ollama, a LiteLLM proxy...) write 'openai/{bare}' with its base_url; "
            f"expected "
            f"{_FORMS}"
        )
    return ValueError(f"bad model spec {spec!r}: expected {_FORMS}")


def parse_model_spec(
    spec: str, *, base_url: str | None = None, api_key: str | None = None, **options: Any
) -> BaseChatModel:
    """Build the model ``spec`` names (``PROVIDER:MODEL`` or ``PROVIDER/MODEL``).

    - ``"simulated"`` / ``"simulated:0.05"``: a ``SimulatedModel`` (optionally with that
      ``latency_s``); ``base_url`` / ``api_key`` must not be given;
    - ``"openai:MODEL"``: ``OpenAIChat(MODEL, base_url=base_url, api_key=api_key)`` for any
      OpenAI-compatible server;
    - ``"anthropic:MODEL"``: ``AnthropicChat(MODEL, base_url=base_url, api_key=api_key)``
      (Anthropic's native Messages API);
    - ``"azure:DEPLOYMENT"``: ``AzureOpenAIChat(DEPLOYMENT, endpoint=base_url,
      api_key=api_key)``, the endpoint, key and api-version otherwise from
      ``AZURE_OPENAI_ENDPOINT``, ``AZURE_OPENAI_API_KEY`` and ``AZURE_OPENAI_API_VERSION``
      / ``OPENAI_API_VERSION``;
    - ``"litellm:MODEL"``: ``LiteLLMChat(MODEL, base_url=base_url, api_key=api_key)``,
      any provider LiteLLM knows, in-process (the ``litellm`` extra; ``ModelConfigError``
      without it), priced from ``ASYNCGRAPH_MODEL_PRICES`` or LiteLLM's cost map.

    ``options`` go to the model's constructor (``retry=``, ``rate_limit=``, ``cache=``,
    ``pricing=``, ``timeout_s=``, ...). A ``rate_limit`` or ``cache`` not given here comes
    from the environment (``ASYNCGRAPH_MODEL_RPM``, ``_TPM``, ``_RATE_REDIS``, ``_CACHE``;
    a ``retry`` from ``ASYNCGRAPH_MODEL_MAX_ATTEMPTS``:
    see ``model_options_from_env``); pass ``rate_limit=None`` / ``cache=None`` to opt out.
    A ``pricing`` not given comes from ``ASYNCGRAPH_MODEL_PRICES`` or the dated price
    table (``PRICES`` in ``asyncgraph/models/_prices.py``; see ``default_pricing``; never for an Azure
    deployment, whose name is its owner's); a model named in neither has none, and its
    cost is reported as unknown. Raises ``ValueError`` for any other spec (a bare
    ``gpt-4o-mini`` or ``claude-...`` names the spec to write) and ``ModelConfigError``
    (also a ``ValueError``) for an invalid environment setting or a ``base_url`` this
    process does not allow.

    Example::

        model = parse_model_spec("simulated:0.05")      # SimulatedModel(latency_s=0.05)
        model = parse_model_spec("openai:llama3", base_url="http://127.0.0.1:8000/v1")
        model = parse_model_spec("anthropic/claude-sonnet-4-20250514", rate_limit=RateLimit(50))
    """
    # A provider's client (httpx, ssl, litellm) loads with the first spec that names it.
    provider, name = split_model_spec(spec)
    has_model = provider != spec.strip().lower() or bool(name)
    if provider == "simulated":
        from asyncgraph.models._simulated import SIMULATED_MODEL_NAME, SimulatedModel

        if base_url is not None or api_key is not None:
            raise ValueError(
                f"model spec {spec!r} is the offline simulated model: it takes no base_url or "
                "api_key (use 'openai:MODEL' for a server)"
            )
        if has_model:
            try:
                options.setdefault("latency_s", float(name))
            except ValueError:
                raise ValueError(
                    f"bad model spec {spec!r}: the simulated latency must be a number of "
                    f"seconds; expected {_FORMS}"
                ) from None
        _env_defaults(options, SIMULATED_MODEL_NAME)
        return SimulatedModel(**options)
    if provider not in _PROVIDERS:
        raise _unknown_spec(spec, provider, has_model)
    if not name:
        what = "DEPLOYMENT" if provider == "azure" else "MODEL"
        example = {
            "openai": "gpt-4o-mini",
            "anthropic": "claude-sonnet-4-20250514",
            "azure": "my-gpt-4o-mini",
            "litellm": "gemini/gemini-2.0-flash",
        }[provider]
        raise ValueError(
            f"model spec {spec!r} names no model: write {provider}:{what} or "
            f"{provider}/{what}, e.g. {provider}:{example}"
        )
    check_base_url(base_url)
    _env_defaults(options, name)
    if provider == "litellm":  # prices from the environment, else from LiteLLM's own map
        from asyncgraph.models._litellm import LiteLLMChat

        if "pricing" not in options and default_pricing(name, table=False) is not None:
            options["pricing"] = default_pricing(name, table=False)
        return LiteLLMChat(name, base_url=base_url, api_key=api_key, **options)
    if "pricing" not in options:
        options["pricing"] = default_pricing(name, table=provider != "azure")
    if provider == "anthropic":
        from asyncgraph.models._anthropic import AnthropicChat

        return AnthropicChat(name, base_url=base_url, api_key=api_key, **options)
    if provider == "azure":
        from asyncgraph.models._azure import AzureOpenAIChat

        return AzureOpenAIChat(name, endpoint=base_url, api_key=api_key, **options)
    from asyncgraph.models._openai import OpenAIChat

    return OpenAIChat(name, base_url=base_url, api_key=api_key, **options)


def _env_defaults(options: dict[str, Any], name: str) -> None:
    """Fill the ``rate_limit`` / ``cache`` options the caller left out from the environment."""
    if "rate_limit" not in options:
        rate_limit = _rate_limit(os.environ, name)
        if rate_limit is not None:
            options["rate_limit"] = rate_limit
    if "cache" not in options:
        cache = _cache(os.environ)
        if cache is not None:
            options["cache"] = cache
    if "retry" not in options:
        retry = _retry(os.environ)
        if retry is not None:
            options["retry"] = retry
