"""A small async Redis client (RESP2) for asyncio and trio, on anyio's socket streams
(and, for plain sockets on asyncio, one of its own: ``_asyncio_stream``).

A leaf: it imports nothing else of asyncgraph, so the model clients (rate limiter,
cache) and the distributed executor and worker share it without depending on each
other. See ``asyncgraph.resp._client`` for why it exists next to redis-py.
"""

from asyncgraph.resp._client import (
    Connection,
    Oversize,
    Pool,
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
    "RedisConnectionLost",
    "ReplyError",
    "Wide",
    "parse_redis_url",
    "redact_url",
]
