"""The Redis client of the rate limiter and the cache: asyncgraph's own (``asyncgraph.resp``).

The same client serves the worker fleet's streams (picked by measurement:
``benchmarks/bench_redis_clients.py``). It runs on asyncio and trio alike, so no call
takes a thread hop. Every call has a deadline (``timeout_s``); a script is sent by its
SHA1 and loaded once when Redis does not know it (``NOSCRIPT``). A call whose
connection is lost is sent again only when that is harmless: by ``asyncgraph.resp``'s
table of safe commands, or when the caller says so (``retry=True``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio.lowlevel

from asyncgraph._exceptions import ModelBackendError
from asyncgraph._redact import redact_url

if TYPE_CHECKING:
    from asyncgraph.resp import Pool

__all__ = ["RedisHandle", "Script"]


class Script:
    """A Lua script, run with EVALSHA (EVAL once if Redis has not seen it)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class RedisHandle:
    """A lazily connected client for ``url``: ``await handle.call(command, ...)``.

    Raises ``ModelBackendError`` (naming ``purpose``) on any Redis error or timeout.
    Connections belong to the event loop that opened them: a handle used from another
    ``anyio.run`` (a later one, or trio after asyncio) opens its own.
    """

    def __init__(self, url: str, *, timeout_s: float, purpose: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Redis timeout_s must be > 0, got {timeout_s!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.purpose = purpose
        # The Redis client loads with the first handle, not with ``asyncgraph.models``.
        from asyncgraph.resp import parse_redis_url

        self._address = parse_redis_url(url)
        self._pools: dict[int, tuple[object, Pool]] = {}

    def _pool(self) -> Pool:
        token = anyio.lowlevel.current_token()
        loop = getattr(token, "native_token", token)
        entry = self._pools.get(id(loop))
        if entry is None or entry[0] is not loop:
            from asyncgraph.resp import Pool

            entry = (loop, Pool(self._address, timeout_s=self.timeout_s, max_idle=4))
            self._pools[id(loop)] = entry
        return entry[1]

    async def call(self, *command: Any, retry: bool | None = None) -> Any:
        (reply,) = await self.pipeline([command], retry=retry)
        return reply

    async def pipeline(
        self, commands: Sequence[Sequence[Any]], *, retry: bool | None = None
    ) -> list[Any]:
        """Run ``commands`` in one round trip (``retry`` as in ``asyncgraph.resp.Pool.pipeline``)."""
        from asyncgraph.resp import RedisConnectionLost, ReplyError

        try:
            replies = await self._pool().pipeline(commands, retry=retry)
        except RedisConnectionLost as exc:
            raise self._error(exc) from exc
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise self._error(reply) from reply
        return replies

    async def run_script(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        retry: bool | None = None,
    ) -> Any:
        """Run ``script``; ``retry=True`` only if running it twice does what once does."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args, retry=retry)
        except ModelBackendError as exc:
            from asyncgraph.resp import ReplyError

            if not (isinstance(exc.__cause__, ReplyError) and exc.__cause__.code == "NOSCRIPT"):
                raise
        return await self.call("EVAL", script.source, len(keys), *keys, *args, retry=retry)

    def _error(self, exc: Exception) -> ModelBackendError:
        return ModelBackendError(
            f"Redis at {redact_url(self.url)} failed during {self.purpose}: "
            f"{type(exc).__name__}: {exc} (each Redis call has a {self.timeout_s}s timeout; "
            "check that Redis is up and reachable)"
        )

    async def aclose(self) -> None:
        """Close the connections of the current event loop's pool (others are dropped)."""
        pools, self._pools = self._pools, {}
        try:
            token = anyio.lowlevel.current_token()
        except RuntimeError:
            return
        loop = getattr(token, "native_token", token)
        for owner, pool in pools.values():
            if owner is loop:
                await pool.aclose()
