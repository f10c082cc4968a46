"""A small async Redis client (RESP2) for asyncio and trio, on anyio's socket streams
(and, for plain sockets on asyncio, one of its own: ``_asyncio_stream``).

A leaf: it imports nothing else of asyncgraph, so the model clients (rate limiter,
cache) and the distributed executor and worker share it without depending on each
other.

Why not redis-py: its asyncio client does not run under trio, and its synchronous
client in worker threads costs a thread hop on every call and on every wake-up of a
blocking read: several of them per remote node, a large part of a round trip's budget
(docs/guide/benchmarks.md has the measurement that chose this client). This client
speaks just what the worker protocol needs: commands, pipelines (one write, N replies),
blocking reads that a cancel scope interrupts at once. Errors: ``RedisConnectionLost``
(also ``ConnectionError``) for anything network, ``ReplyError`` for an error reply of
the server.

One concept a module, imports going down the list (a test holds them free of cycles):

- ``_url_options``, ``_address``: a URL read into a ``RedisAddress``, its options checked;
- ``_protocol``, ``_hiredis_protocol``: RESP2 encoded and parsed, in pure Python and by
  hiredis, within a call's limits (``Oversize``, ``Wide``);
- ``_asyncio_stream``, ``_connection``: one connection to one node (or Sentinel's master);
- ``_cluster``: a Redis Cluster's connections, routed by hash slot;
- ``_idempotence``, ``_pool``: the pool that hands connections out and retries what is
  safe to repeat; it chooses, once, between one node and a cluster.
"""

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph._redact import redact_url
from asyncgraph.resp._address import parse_redis_url
from asyncgraph.resp._connection import Connection
from asyncgraph.resp._pool import Pool
from asyncgraph.resp._protocol import Oversize, Wide

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
