"""A small async Redis client (RESP2) on anyio streams: asyncio and trio.

A leaf: it imports nothing else of asyncgraph, so the model clients (rate limiter,
cache) and the distributed executor and worker share it without depending on each
other. See ``asyncgraph.resp._client`` for why it exists next to redis-py.
"""

from asyncgraph.resp._client import (
    Connection,
    Oversize,
    Pool,
    RedisAddress,
    RedisConnectionLost,
    ReplyError,
    Wide,
    parse_redis_url,
    redact_url,
)

__all__ = [
    "Connection",
    "Oversize",
    "Pool",
    "RedisAddress",
    "RedisConnectionLost",
    "ReplyError",
    "Wide",
    "parse_redis_url",
    "redact_url",
]
