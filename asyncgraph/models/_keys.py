"""Every Redis key shape used by ``asyncgraph.models``, defined once.

The ``{...}`` hash tag keeps the keys of one rate limit in the same Redis Cluster slot,
so the Lua script that touches both may run there too.
"""

from __future__ import annotations

__all__ = ["CACHE_PREFIX", "cache_key", "rate_limit_keys", "rate_limit_once_key"]

PREFIX = "asyncgraph:models"
CACHE_PREFIX = f"{PREFIX}:cache:"


def rate_limit_keys(name: str) -> tuple[str, str]:
    """Keys holding the GCRA "theoretical arrival time" of requests and of tokens."""
    base = f"{PREFIX}:ratelimit:{{{name}}}"
    return f"{base}:requests", f"{base}:tokens"


def rate_limit_once_key(name: str, call_id: str) -> str:
    """Key holding what one limiter call did, so that the call sent twice does it once."""
    return f"{PREFIX}:ratelimit:{{{name}}}:once:{call_id}"


def cache_key(digest: str, prefix: str = CACHE_PREFIX) -> str:
    """Key of one cached completion (``digest`` is the request's sha256 hex)."""
    return f"{prefix}{digest}"
