"""A synchronous redis-py client driven from worker threads, with a timeout on every call.

redis-py's asyncio client runs on asyncio only; asyncgraph must also run under trio, so
the limiter and the cache call the thread-safe synchronous client through
``anyio.to_thread.run_sync``. Every call is bounded by the socket timeouts, and redis-py's
own retries are off so a timed-out script is never run twice behind our back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry as RedisRetry

from asyncgraph.models._exceptions import ModelBackendError
from asyncgraph.resp import redact_url

__all__ = ["RedisHandle", "redact_url"]

T = TypeVar("T")


class RedisHandle:
    """A lazily connected client for ``url``; ``await handle.call(fn)`` runs ``fn(client)``.

    Raises ``ModelBackendError`` (naming ``purpose``) on any Redis error or timeout.
    ``close()`` drops the connections; a later call reconnects.
    """

    def __init__(self, url: str, *, timeout_s: float, purpose: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Redis timeout_s must be > 0, got {timeout_s!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.purpose = purpose
        self._lock = threading.Lock()
        self._client: redis.Redis | None = None

    def client(self) -> redis.Redis:
        with self._lock:
            if self._client is None:
                self._client = redis.Redis.from_url(
                    self.url,
                    socket_timeout=self.timeout_s,
                    socket_connect_timeout=self.timeout_s,
                    retry=RedisRetry(NoBackoff(), 0),
                )
            return self._client

    async def call(self, fn: Callable[[redis.Redis], T]) -> T:
        client = self.client()
        try:
            return await anyio.to_thread.run_sync(fn, client)
        except redis.RedisError as exc:
            raise ModelBackendError(
                f"Redis at {redact_url(self.url)} failed during {self.purpose}: "
                f"{type(exc).__name__}: {exc} (each Redis call has a {self.timeout_s}s timeout; "
                "check that Redis is up and reachable)"
            ) from exc

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
