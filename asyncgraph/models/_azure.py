"""``AzureOpenAIChat``: an Azure OpenAI deployment, on the OpenAI client's code.

Azure serves the chat completions protocol per deployment:
``POST {endpoint}/openai/deployments/{deployment}/chat/completions?api-version=V`` with
an ``api-key: KEY`` header (or ``Authorization: Bearer TOKEN`` for a Microsoft Entra ID
token). The body is OpenAI's without ``model`` (the deployment names it) and the
answer is OpenAI's, prompt-cache usage included (``chat_completion`` reads both).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from asyncgraph._exceptions import ModelConfigError
from asyncgraph._redact import redact_url
from asyncgraph.models._cache import Cache
from asyncgraph.models._http import HttpChatModel, checked_http_url
from asyncgraph.models._openai import chat_completion
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter
from asyncgraph.models._warming import leading_prefix_key

__all__ = [
    "DEFAULT_AZURE_API_VERSION",
    "ENV_AZURE_AD_TOKEN",
    "ENV_AZURE_API_KEY",
    "ENV_AZURE_ENDPOINT",
    "ENV_AZURE_VERSIONS",
    "AzureOpenAIChat",
]

# The newest generally available data-plane version when this client was written
# (preview versions are opt-in: pass api_version= or set the variable).
DEFAULT_AZURE_API_VERSION = "2024-10-21"
ENV_AZURE_ENDPOINT = "AZURE_OPENAI_ENDPOINT"
ENV_AZURE_API_KEY = "AZURE_OPENAI_API_KEY"
ENV_AZURE_AD_TOKEN = "AZURE_OPENAI_AD_TOKEN"
# LiteLLM's and the openai SDK's names, in that order of precedence.
ENV_AZURE_VERSIONS = ("AZURE_OPENAI_API_VERSION", "OPENAI_API_VERSION")

_STATUS_HINTS = {
    400: "check the messages and params",
    401: f"check the key or token (api_key= / {ENV_AZURE_API_KEY}, azure_ad_token= / "
    f"{ENV_AZURE_AD_TOKEN}) and that it belongs to this endpoint",
    403: "check the key's or token's access to this resource",
    404: "check the deployment name, the endpoint and the api-version",
    422: "check the messages and params",
}


class AzureOpenAIChat(HttpChatModel):
    """A chat deployment of an Azure OpenAI resource (see the module docstring).

    ``deployment`` is the deployment's name (Azure's, chosen by its owner; not
    necessarily the model's). ``endpoint`` defaults to ``AZURE_OPENAI_ENDPOINT``
    (``https://RESOURCE.openai.azure.com``); ``api_key`` to ``AZURE_OPENAI_API_KEY``
    (sent as ``api-key``), or ``azure_ad_token`` (default ``AZURE_OPENAI_AD_TOKEN``) for
    Entra ID (sent as ``Authorization: Bearer``); one of them is required.
    ``api_version`` defaults to ``AZURE_OPENAI_API_VERSION``, then ``OPENAI_API_VERSION``,
    then ``DEFAULT_AZURE_API_VERSION`` (``2024-10-21``). Everything else (retries,
    timeouts, rate limit, cache, usage with cached prompt tokens, redaction of the key,
    ``max_tokens`` / ``max_concurrency`` / ``context_tokens``) is ``OpenAIChat``'s; a
    deployment's context window is not in the table (its name is the owner's): give
    ``context_tokens=``. A deployment has no price in the shipped table (its name is the
    owner's): give ``pricing=`` or ``ASYNCGRAPH_MODEL_PRICES=DEPLOYMENT=IN/OUT/CACHED``.

    Example::

        async with AzureOpenAIChat(
            "my-gpt4o", endpoint="https://RESOURCE.openai.azure.com",
            pricing=Pricing(input_usd_per_1m=2.5, output_usd_per_1m=10),
        ) as model:
            answer = await model.complete([{"role": "user", "content": "Hi"}])
    """

    _status_hints = _STATUS_HINTS
    _answer_kind = "a chat completion"

    def __init__(
        self,
        deployment: str,
        endpoint: str | None = None,
        api_key: str | None = None,
        *,
        api_version: str | None = None,
        azure_ad_token: str | None = None,
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
        if not deployment or "/" in deployment:
            raise ValueError(
                f"AzureOpenAIChat needs a deployment name without '/', got {deployment!r} "
                "(e.g. AzureOpenAIChat('my-gpt-4o-mini'))"
            )
        chosen = endpoint or os.environ.get(ENV_AZURE_ENDPOINT)
        if not chosen:
            raise ModelConfigError(
                f"{ENV_AZURE_ENDPOINT} is not set: Azure deployment {deployment!r} needs its "
                f"resource's endpoint. Set {ENV_AZURE_ENDPOINT}=https://RESOURCE.openai.azure.com "
                "(or pass endpoint=...)",
                variable=ENV_AZURE_ENDPOINT,
                value="",
            )
        checked = checked_http_url(
            chosen,
            variable="endpoint" if endpoint else ENV_AZURE_ENDPOINT,
            example="https://RESOURCE.openai.azure.com",
        )
        version = api_version or next(
            (os.environ[v] for v in ENV_AZURE_VERSIONS if os.environ.get(v, "").strip()),
            DEFAULT_AZURE_API_VERSION,
        )
        key = api_key if api_key is not None else os.environ.get(ENV_AZURE_API_KEY)
        token = azure_ad_token if azure_ad_token is not None else os.environ.get(ENV_AZURE_AD_TOKEN)
        if key:
            auth = {"api-key": key}
        elif token:
            auth = {"authorization": f"Bearer {token}"}
        else:
            raise ModelConfigError(
                f"{ENV_AZURE_API_KEY} is not set: Azure deployment {deployment!r} needs a key "
                f"or an Entra ID token. Set {ENV_AZURE_API_KEY} (or pass api_key=...), or "
                f"{ENV_AZURE_AD_TOKEN} (azure_ad_token=...)",
                variable=ENV_AZURE_API_KEY,
                value="",
            )
        super().__init__(
            deployment,
            url=_deployment_url(checked, deployment, version.strip()),
            base_url=checked,
            headers={**(headers or {}), **auth},
            secrets=[s for s in (key, token) if s],
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
        self.deployment = deployment
        self.endpoint = checked
        self.api_version = version.strip()

    @property
    def cache_endpoint(self) -> str:
        """The deployment's URL (with its api-version): the same request to another
        deployment or version is another."""
        return redact_url(self.url)

    def _body(self, messages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.default_params, **params, "messages": messages}

    def _completion(self, data: Any, params: Mapping[str, Any]) -> Completion:
        return chat_completion(data, self.deployment)

    def _cache_prefix(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> str | None:
        """The first 1,024 tokens: Azure OpenAI caches them as OpenAI does (NOTE [Cache
        warming])."""
        return leading_prefix_key(self.deployment, messages, self.estimator.chars_per_token)

    def __repr__(self) -> str:
        return (
            f"AzureOpenAIChat({self.deployment!r}, endpoint={redact_url(self.endpoint)!r}, "
            f"api_version={self.api_version!r})"
        )


def _deployment_url(endpoint: str, deployment: str, version: str) -> str:
    parts = urlsplit(endpoint)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "api-version"]
    query.append(("api-version", version))
    path = f"{parts.path.rstrip('/')}/openai/deployments/{quote(deployment, safe='')}"
    return urlunsplit(
        (parts.scheme, parts.netloc, f"{path}/chat/completions", urlencode(query), "")
    )
