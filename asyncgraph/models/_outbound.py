"""The one outbound policy: where a request carrying this process's credentials may go.

NOTE [Outbound policy]
A worker calls models with its own credentials (``OPENAI_API_KEY``,
``ANTHROPIC_API_KEY``, ``AZURE_OPENAI_API_KEY``, whatever LiteLLM reads) for tasks that
clients send. Two things a task controls could send them somewhere else, and both pass
this one policy:

1. the ``base_url`` of a model the task names by spec (``ModelRef.base_url``):
   ``check_base_url``, called where a spec becomes a model (``parse_model_spec``,
   ``asyncgraph.text.resolve_model``);
2. the params of each call (``complete(messages, **params)``; a text function's
   ``params`` / ``feedback_params``): ``check_call_params``, called by
   ``BaseChatModel.complete`` for every provider, before the cache, the call journal or
   any send. ``complete`` is the one entry point of every client, so a provider cannot
   skip it.

Both read one allow-list, installed by ``restrict_base_urls`` when a worker starts
serving (``asyncgraph.models._spec``: the providers' default URLs, the environment's
``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL`` / ``AZURE_OPENAI_ENDPOINT``, and
``--allow-base-url`` / ``ASYNCGRAPH_ALLOWED_BASE_URLS``). A process with no restriction
(an application: its own code, its own key) is not checked: it may send its key where
it chooses.

In a restricted process a call's param passes by its name:

- ``DESTINATION_PARAMS`` (``api_base``, ``base_url``, ``azure_endpoint``): only an
  allowed base URL (the request, and the key with it, would go there);
- ``CREDENTIAL_PARAMS`` (``api_key``, ``headers``, ``extra_headers``, ...): never. A
  task may not set or replace what a request carries; the operator configures a
  worker's credentials, or registers a model configured with them;
- any other name: as the provider declares in ``request_params``. ``None``: any, for a
  client that only puts params in the JSON body of a request to its own URL with its
  own headers (every ``HttpChatModel``; ``SimulatedModel``, which sends nothing). A set:
  only those names, for a client that hands params to a library that may read a name
  as where to send the request or what to carry (``LiteLLMChat``: LiteLLM reads
  hundreds of names, endpoints, cloud credentials and logging callbacks among them).
  ``BaseChatModel``'s default is ``CHAT_PARAMS``: a new client that declares nothing
  gets the strict rule.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from asyncgraph._exceptions import ModelConfigError
from asyncgraph._redact import redact, redact_url

__all__ = [
    "CHAT_PARAMS",
    "CREDENTIAL_PARAMS",
    "DESTINATION_PARAMS",
    "ENV_ALLOWED_BASE_URLS",
    "BaseUrlRestriction",
    "allowed_base_urls",
    "check_base_url",
    "check_call_params",
    "normalize_base_url",
    "param_refusal",
]

ENV_ALLOWED_BASE_URLS = "ASYNCGRAPH_ALLOWED_BASE_URLS"

# Params whose value is where the request goes (LiteLLM's, the openai SDK's, Azure's).
DESTINATION_PARAMS = frozenset({"api_base", "base_url", "azure_endpoint"})
# Params that set what a request carries: a credential, a header, a query string (where
# Azure takes ``api-key``), the organization a key bills.
CREDENTIAL_PARAMS = frozenset(
    {
        "api_key",
        "headers",
        "extra_headers",
        "default_headers",
        "extra_query",
        "azure_ad_token",
        "azure_ad_token_provider",
        "organization",
    }
)
# The chat completion request's own params (OpenAI's, as LiteLLM maps them to each
# provider): what a task may give a client that declares nothing else.
CHAT_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "n",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "seed",
        "user",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "reasoning_effort",
        "thinking",
        "verbosity",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "service_tier",
        "store",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)

_HOW_TO_REGISTER = (
    "register a model configured with it under a name, in a module the workers import "
    "(asyncgraph worker --import your_module), and pass that name"
)

# Process-wide on purpose: the credentials it guards are the process's. Each active
# restriction (one per worker serving in this process) adds its URLs.
_lock = threading.Lock()
_restrictions: dict[int, frozenset[str]] = {}


def normalize_base_url(url: str) -> str:
    """``url`` as compared with the allowed ones: scheme and host lower-cased, no trailing /.

    Raises ``ValueError`` unless it is an absolute ``http://`` or ``https://`` URL.
    """
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base URL {redact_url(url)!r} is not an http:// or https:// URL")
    return urlunsplit(
        (
            parts.scheme.lower(),
            parts.netloc.lower(),
            parts.path.rstrip("/"),
            parts.query,
            parts.fragment,
        )
    )


class BaseUrlRestriction:
    """Handle of ``restrict_base_urls``; ``remove()`` lifts this restriction."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        with _lock:
            _restrictions[id(self)] = allowed

    def remove(self) -> None:
        with _lock:
            _restrictions.pop(id(self), None)


def allowed_base_urls() -> frozenset[str] | None:
    """The base URLs (normalized) this process may send its credentials to, or None
    when it is not restricted (no worker serves in it)."""
    with _lock:
        if not _restrictions:
            return None
        return frozenset().union(*_restrictions.values())


def _is_allowed(url: object, allowed: frozenset[str]) -> bool:
    if not isinstance(url, str):
        return False
    try:
        return normalize_base_url(url) in allowed
    except ValueError:
        return False


def _shown(value: object) -> str:
    """A destination as an error shows it: a URL without its credentials."""
    return redact_url(value) if isinstance(value, str) else redact(f"{value!r:.80}")


def _not_allowed(what: str, shown: str, allowed: frozenset[str]) -> str:
    return (
        f"{what} is not allowed in this process: a worker sends its own API key to a "
        f"model's base URL, so it only uses the URLs its operator allows (allowed: "
        f"{', '.join(sorted(redact_url(url) for url in allowed))}). To allow this one, "
        f"start the workers with --allow-base-url {shown} (or add it to "
        f"{ENV_ALLOWED_BASE_URLS}, comma-separated); or register a model under a name in "
        f"a module the workers import and pass that name"
    )


def check_base_url(base_url: str | None) -> None:
    """Raise ``ModelConfigError`` if this process is restricted and ``base_url`` is not allowed.

    Example::

        # On a worker started with --allow-base-url http://vllm:8000/v1:
        check_base_url("http://vllm:8000/v1")           # allowed: returns None
        check_base_url("http://elsewhere:8000/v1")      # ModelConfigError naming the URL
    """
    if base_url is None:
        return
    allowed = allowed_base_urls()
    if allowed is None or _is_allowed(base_url, allowed):
        return
    shown = _shown(base_url)
    raise ModelConfigError(
        _not_allowed(f"base_url {shown!r}", shown, allowed),
        variable=ENV_ALLOWED_BASE_URLS,
        value=shown,
    )


def param_refusal(
    name: str,
    value: object,
    *,
    allowed: frozenset[str],
    request_params: frozenset[str] | None,
    client: str,
) -> str | None:
    """Why a restricted process refuses the call param ``name=value`` (the reason, naming
    the param and what to do), or None when it passes (see NOTE [Outbound policy]).

    ``allowed``: the allowed base URLs (normalized); ``request_params``: the client's
    declaration (None: any other name); ``client``: its class name, for the message.
    """
    if name in DESTINATION_PARAMS:
        if _is_allowed(value, allowed):
            return None
        shown = _shown(value)
        return _not_allowed(f"param {name}={shown!r}", shown, allowed)
    if name in CREDENTIAL_PARAMS:
        return (
            f"param {name!r} is refused in this process (its value is not shown): a "
            f"worker calls models with its own credentials and headers, and a task may "
            f"not set or replace them. Leave it out of the task's params; the operator "
            f"sets credentials in the workers' environment, or may {_HOW_TO_REGISTER}"
        )
    if request_params is None or name in request_params:
        return None
    return (
        f"param {name!r} is refused in this process: {client} hands its params to a "
        f"library that may read this one as where to send the request or what it carries "
        f"(an endpoint, a credential, a callback), so a task may give it only "
        f"{', '.join(sorted(request_params))} and an allowed "
        f"{' / '.join(sorted(DESTINATION_PARAMS))}. Leave it out of the task's params, or "
        f"the operator may {_HOW_TO_REGISTER}"
    )


def check_call_params(
    model: str, client: str, request_params: frozenset[str] | None, params: Mapping[str, Any]
) -> None:
    """Raise ``ModelConfigError`` naming the first param of a call this process refuses
    (``param_refusal``); nothing when it is not restricted. ``BaseChatModel.complete``
    calls it before anything is sent."""
    allowed = allowed_base_urls()
    if allowed is None:
        return
    for name in sorted(params):
        reason = param_refusal(
            name,
            params[name],
            allowed=allowed,
            request_params=request_params,
            client=client,
        )
        if reason is not None:
            value = _shown(params[name]) if name in DESTINATION_PARAMS else ""
            raise ModelConfigError(f"{model!r}: {reason}", variable=name, value=value)
