"""One connection to one Redis node: commands and pipelines with a deadline, same code on
asyncio and trio.

It reads and writes anyio's socket streams (``anyio.connect_tcp``, with TLS or without,
and ``anyio.connect_unix``), and a deadline per call is an ``anyio.fail_after``, on every
event loop anyio runs on; but plain sockets on asyncio, which get the one stream of its
own (``_asyncio_stream``: the one per-loop branch kept for speed, chosen in ``_connect``
and listed in docs/guide/architecture.md).

Every call has a deadline (``timeout_s``, ``call_deadline``): how long Redis may stay
silent, not how long a reply that keeps arriving may take to read (a big one, parsed on a
loaded machine, takes longer to read than Redis takes to send). A connection that saw a
timeout, a cancellation or a protocol error mid-command is closed, never reused. Through
sentinels (``redis+sentinel://``), a connection goes to the master they name. A Redis
Cluster is not one node: ``Pool`` opens its connections (``_cluster``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph.resp._address import RedisAddress
from asyncgraph.resp._asyncio_stream import open_asyncio_stream
from asyncgraph.resp._hiredis_protocol import new_reader, pack
from asyncgraph.resp._protocol import MORE, RECV, Arg

__all__ = ["Connection", "call_deadline"]

# The deadlines of the Redis calls this task is in (``call_deadline``), innermost last.
_CALLS: ContextVar[tuple[tuple[anyio.CancelScope, float], ...]] = ContextVar(
    "asyncgraph_resp_calls", default=()
)


@contextmanager
def call_deadline(timeout_s: float, *, shield: bool = False) -> Iterator[anyio.CancelScope]:
    """``anyio.fail_after(timeout_s)`` around one Redis call, pushed back while its reply
    arrives: each part of a reply that is not whole yet gives the rest ``timeout_s`` again.
    So ``TimeoutError`` means Redis stayed silent for ``timeout_s``, never that the client
    was slow to parse what it sent (a worker reading an entry of 400,000 fields on a loaded
    machine would otherwise cut that read every time, and never get past the entry)."""
    with anyio.fail_after(timeout_s, shield=shield) as scope:
        token = _CALLS.set((*_CALLS.get(), (scope, timeout_s)))
        try:
            yield scope
        finally:
            _CALLS.reset(token)


def _heard_from_redis() -> None:
    """Part of a reply came and the rest is awaited: the calls' deadlines start again."""
    now = anyio.current_time()
    for scope, timeout_s in _CALLS.get():
        if not scope.cancel_called and scope.deadline < now + timeout_s:
            scope.deadline = now + timeout_s


async def _master_of(address: RedisAddress) -> tuple[str, int]:
    """Ask the sentinels, in turn, where the master of ``address.service`` is."""
    errors = []
    for host, port in address.sentinels:
        sentinel = RedisAddress(
            display=f"sentinel {host}:{port}",
            host=host,
            port=port,
            password=address.sentinel_password,
        )
        try:
            conn = await Connection.open(sentinel, 2.0)
        except (RedisConnectionLost, ReplyError) as exc:
            errors.append(f"{host}:{port}: {exc}")
            continue
        try:
            reply = await conn.execute("SENTINEL", "get-master-addr-by-name", address.service or "")
        except (RedisConnectionLost, ReplyError) as exc:
            errors.append(f"{host}:{port}: {exc}")
            continue
        finally:
            await conn.aclose()
        if isinstance(reply, list) and len(reply) == 2:
            return bytes(reply[0]).decode(), int(reply[1])
        errors.append(f"{host}:{port}: does not know {address.service!r}")
    raise RedisConnectionLost(
        f"no sentinel of {address.display} named the master of {address.service!r}: "
        + "; ".join(errors)
    )


def _keep_alive(stream: anyio.abc.ByteStream) -> None:
    """TCP keepalive: a connection the network dropped silently errors within ~30 s."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def _connect(address: RedisAddress) -> anyio.abc.ByteStream:
    if address.ssl_context is None and isinstance(
        anyio.lowlevel.current_token().native_token, asyncio.AbstractEventLoop
    ):
        # The one per-loop branch kept for speed: see _asyncio_stream.
        plain = await open_asyncio_stream(address.host, address.port, address.path)
        _keep_alive(plain)
        return plain
    if address.path is not None:
        return await anyio.connect_unix(address.path)
    if address.ssl_context is not None:
        # Redis servers may close TLS without close_notify: not an error here.
        stream: anyio.abc.ByteStream = await anyio.connect_tcp(
            address.host,
            address.port,
            ssl_context=address.ssl_context,
            tls_standard_compatible=False,
        )
    else:
        stream = await anyio.connect_tcp(address.host, address.port)
    _keep_alive(stream)
    return stream


class Connection:
    """One connection. Not shared between tasks; ``Pool`` hands them out.

    Example::

        async with pool.connection() as conn:          # a Connection, this task's alone
            print(await conn.execute("PING"))          # b'PONG'
            print(await conn.pipeline([["SET", "a", 1], ["GET", "a"]]))   # [b'OK', b'1']
    """

    def __init__(self, address: RedisAddress, stream: anyio.abc.ByteStream) -> None:
        self.address = address
        self._stream = stream
        self._reader = new_reader()
        self.broken = False

    @classmethod
    async def open(cls, address: RedisAddress, timeout_s: float) -> Connection:
        """Connect, authenticate and select the database, all within ``timeout_s``.

        Through sentinels: to the master they name, checked with ``ROLE`` (a master the
        sentinels have not yet demoted after a failover is refused, to ask again). A
        Redis Cluster's address raises ``ValueError``: ``Pool.connect`` routes a cluster.
        """
        if address.sentinels:
            return await cls._open_master(address, timeout_s)
        if address.cluster:
            raise ValueError(
                f"{address.display} is a Redis Cluster, not one node: connect to it with "
                f"Pool(address).connect(), which routes each command to its slot's master"
            )
        stream: anyio.abc.ByteStream | None = None
        try:
            with anyio.fail_after(timeout_s):
                stream = await _connect(address)
                conn = cls(address, stream)
                setup: list[list[Arg]] = []
                if address.password is not None:
                    setup.append(
                        ["AUTH", address.username, address.password]
                        if address.username
                        else ["AUTH", address.password]
                    )
                if address.db:
                    setup.append(["SELECT", address.db])
                for reply in await conn.pipeline(setup) if setup else ():
                    if isinstance(reply, ReplyError):
                        raise reply
                return conn
        except (ReplyError, RedisConnectionLost):
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            raise
        except (
            OSError,
            TimeoutError,
            anyio.BrokenResourceError,
            anyio.EndOfStream,
            ssl.SSLError,
        ) as exc:
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            raise RedisConnectionLost(
                f"cannot connect to Redis at {address.display}: {type(exc).__name__}: {exc}"
            ) from exc

    @classmethod
    async def _open_master(cls, address: RedisAddress, timeout_s: float) -> Connection:
        try:
            with anyio.fail_after(timeout_s):
                host, port = await _master_of(address)
                conn = await cls.open(
                    replace(address, host=host, port=port, sentinels=()), timeout_s
                )
                conn.address = address
                role = await conn.execute("ROLE")
        except TimeoutError:
            raise RedisConnectionLost(
                f"no master of {address.display} answered within {timeout_s:g}s"
            ) from None
        if not (isinstance(role, list) and role and role[0] == b"master"):
            await conn.aclose()
            raise RedisConnectionLost(
                f"{host}:{port}, named master of {address.service!r} by the sentinels of "
                f"{address.display}, is not a master (a failover is in progress)"
            )
        return conn

    async def execute(
        self,
        *args: Arg,
        max_bulk: int | None = None,
        max_items: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Run one command; raise ``ReplyError`` if Redis answers with an error."""
        (reply,) = await self.pipeline(
            [args], max_bulk=max_bulk, max_items=max_items, timeout_s=timeout_s
        )
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def pipeline(
        self,
        commands: Sequence[Sequence[Arg]],
        *,
        max_bulk: int | None = None,
        max_items: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Send all commands in one write; return their replies (errors as ``ReplyError``).

        ``max_bulk``: bulk strings longer than this come back as ``Oversize`` (unread),
        arrays longer than this raise ``RedisConnectionLost``. ``max_items``: arrays of
        more items come back as ``Wide`` (unread). ``timeout_s``: ``TimeoutError`` when
        Redis stays silent that long before the replies are all in (``call_deadline``;
        the connection is closed).
        """
        if timeout_s is None:
            return await self._pipeline(commands, max_bulk, max_items)
        with call_deadline(timeout_s):
            return await self._pipeline(commands, max_bulk, max_items)

    async def _pipeline(
        self, commands: Sequence[Sequence[Arg]], max_bulk: int | None, max_items: int | None
    ) -> list[Any]:
        if self.broken:
            raise RedisConnectionLost(f"connection to Redis at {self.address.display} is closed")
        data = pack(commands)
        try:
            await self._stream.send(data)
            replies = [await self._read(max_bulk, max_items) for _ in commands]
        except BaseException as exc:
            # A command cut short leaves replies in flight: the connection is unusable.
            self.broken = True
            await anyio.aclose_forcefully(self._stream)
            if isinstance(
                exc,
                (
                    OSError,
                    anyio.BrokenResourceError,
                    anyio.EndOfStream,
                    anyio.ClosedResourceError,
                    ssl.SSLError,
                ),
            ):
                raise RedisConnectionLost(
                    f"lost the connection to Redis at {self.address.display}: "
                    f"{type(exc).__name__}: {str(exc) or 'connection closed'}"
                ) from exc
            raise
        if self.address.sentinels:
            for reply in replies:
                if isinstance(reply, ReplyError) and reply.code == "READONLY":
                    # The master we had was demoted by a failover: ask the sentinels again.
                    self.broken = True
                    await anyio.aclose_forcefully(self._stream)
                    raise RedisConnectionLost(
                        f"{self.address.display}: the master became a replica ({reply}); "
                        f"the sentinels name the new one on the next connection"
                    )
        return replies

    async def _read(self, cap: int | None, max_items: int | None) -> Any:
        reader = self._reader
        reader.cap, reader.max_items = cap, max_items
        heard = False
        while True:
            value = reader.next_reply()
            if value is not MORE:
                return value
            if heard:  # a reply too big for one read: not silence (see call_deadline)
                _heard_from_redis()
            reader.feed(await self._stream.receive(RECV))
            heard = True

    async def aclose(self) -> None:
        self.broken = True
        await anyio.aclose_forcefully(self._stream)
