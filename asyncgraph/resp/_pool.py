"""A pool of connections to one Redis (a node, a Sentinel service or a Cluster), with a
deadline per call and a retry only where a repeat is harmless.

The pool chooses, once, when it is made, how its connections are opened: to the one node
(or the master the sentinels name) by ``Connection.open``, or, for a Redis Cluster, by a
``ClusterRouter`` that the pool's connections share. A command then goes to a connection
as it is, with no routing step of the pool's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from typing import Any

import anyio

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph.resp._address import RedisAddress
from asyncgraph.resp._cluster import ClusterRouter
from asyncgraph.resp._connection import Connection, call_deadline
from asyncgraph.resp._idempotence import unsafe_command
from asyncgraph.resp._protocol import Arg

__all__ = ["Pool"]

_NO_SCOPE = nullcontext()


class Pool:
    """Idle connections to one Redis, handed to one task at a time, with a deadline per call.

    Example::

        pool = Pool(parse_redis_url("redis://127.0.0.1:6379/0"), timeout_s=5.0)
        print(await pool.execute("PING"))     # b'PONG'
        await pool.aclose()
    """

    def __init__(self, address: RedisAddress, *, timeout_s: float, max_idle: int = 8) -> None:
        if timeout_s <= 0:
            raise ValueError(f"Redis timeout_s must be > 0, got {timeout_s!r}")
        self.address = address
        self.timeout_s = timeout_s
        self._idle: list[Connection] = []
        self._max_idle = max_idle
        self._closed = False
        # Of a Redis Cluster: where each slot is served, shared by the pool's connections.
        self.router = ClusterRouter(address, timeout_s) if address.cluster else None

    async def connect(self) -> Connection:
        """A new connection that the caller owns (for blocking reads); close it when done.

        Of a Redis Cluster: one that routes each command to its slot's master (the
        pool's connections share what they learn of the cluster).
        """
        if self._closed:
            raise RedisConnectionLost(f"the client of Redis at {self.address.display} is closed")
        if self.router is not None:
            return await self.router.connect()
        return await Connection.open(self.address, self.timeout_s)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        conn = self._idle.pop() if self._idle else await self.connect()
        try:
            yield conn
        finally:
            await self._put_back(conn)

    async def _put_back(self, conn: Connection) -> None:
        if not conn.broken and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        elif not conn.broken:
            await conn.aclose()

    async def _discard_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    async def execute(
        self,
        *args: Arg,
        timeout_s: float | None = None,
        max_bulk: int | None = None,
        max_items: int | None = None,
        retry: bool | None = None,
    ) -> Any:
        """Run one command (see ``pipeline``); raise ``ReplyError`` if Redis answers with one."""
        (reply,) = await self.pipeline(
            [args], timeout_s=timeout_s, max_bulk=max_bulk, max_items=max_items, retry=retry
        )
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def pipeline(
        self,
        commands: Sequence[Sequence[Arg]],
        *,
        timeout_s: float | None = None,
        max_bulk: int | None = None,
        max_items: int | None = None,
        shield: bool = False,
        retry: bool | None = None,
    ) -> list[Any]:
        """Run commands in one round trip within ``timeout_s`` (default: the pool's).

        ``max_bulk`` as in ``Connection.pipeline``. ``shield``: the caller's
        cancellation waits until the commands are answered (or the deadline passes),
        for writes that must not be cut in the middle.

        A pooled connection that fails (Redis restarted, or a NAT forgot the connection
        and the call timed out) may have delivered the commands, and Redis may have run
        them. They are sent once more, on a new connection, only when that is safe:
        ``retry=None`` (the default) when every command is in the table of
        ``asyncgraph.resp._idempotence`` (reads, and writes that set rather than add);
        ``retry=True`` when the caller makes a repeat harmless (an idempotency key, or a
        protocol that joins duplicates); never with ``retry=False``. Otherwise the
        failure raises ``RedisConnectionLost``, saying the commands were not sent again.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        if self._idle:
            conn = self._idle.pop()
            try:
                with anyio.CancelScope(shield=True) if shield else _NO_SCOPE:
                    return await conn.pipeline(
                        commands, max_bulk=max_bulk, max_items=max_items, timeout_s=limit
                    )
            except (RedisConnectionLost, TimeoutError) as exc:
                # The idle connections predate an outage or went dead without a word: drop
                # them all, and try once on a new one if a repeat cannot do harm.
                await self._discard_idle()
                if retry is False:
                    raise self._not_repeated(exc, "the caller asked for no retry", limit) from exc
                unsafe = None if retry else unsafe_command(commands)
                if unsafe is not None:
                    why = (
                        f"{unsafe} may have run, and is not known safe to run twice; pass "
                        f"retry=True if the caller makes a repeat harmless"
                    )
                    raise self._not_repeated(exc, why, limit) from exc
            finally:
                await self._put_back(conn)
        try:
            with call_deadline(limit, shield=shield):
                async with self.connection() as conn:
                    return await conn.pipeline(commands, max_bulk=max_bulk, max_items=max_items)
        except TimeoutError:
            raise RedisConnectionLost(
                f"Redis at {self.address.display} did not answer within {limit:g}s"
            ) from None

    def _not_repeated(self, exc: Exception, why: str, limit: float) -> RedisConnectionLost:
        what = (
            str(exc)
            if isinstance(exc, RedisConnectionLost)
            else f"Redis at {self.address.display} did not answer within {limit:g}s"
        )
        return RedisConnectionLost(f"{what} (not sent again: {why})")

    async def aclose(self) -> None:
        self._closed = True
        await self._discard_idle()
