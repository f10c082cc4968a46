"""The one per-loop branch kept for speed: a plain TCP or Unix-socket byte stream for asyncio.

Kept because it wins a user-visible figure by more than 20% (the round trip of a remote
node; see "Per-loop branches kept" in docs/guide/architecture.md for the figure and the
benchmark). anyio's asyncio ``SocketStream`` stops reading between two ``receive``
calls (``pause_reading`` / ``resume_reading``: two ``epoll_ctl`` system calls a read)
and ends every ``send`` with a checkpoint (one more pass of the event loop); anyio's
public ``wait_readable`` costs the same two system calls a wait. For a Redis
connection, which sends a request and then waits for its reply, both are pure cost.

This stream keeps reading into a queue (pausing only past ``HIGH_WATER`` bytes
unread, so memory stays bounded) and writes at once; ``send`` waits only while the
transport's buffer is full. It raises what anyio's streams raise
(``BrokenResourceError``, ``EndOfStream``, ``ClosedResourceError``), so the client
treats both alike; a call's deadline is the client's ``anyio.fail_after``, as on
anyio's streams. Only asyncio, only plain sockets: TLS and trio keep anyio's streams.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc

__all__ = ["HIGH_WATER", "LOW_WATER", "AsyncioStream", "open_asyncio_stream"]

HIGH_WATER = 1 << 20  # unread bytes past which the socket is not read any more
LOW_WATER = 1 << 18  # ... until the reader has taken them below this


class _Protocol(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.unread = 0
        self.reading_paused = False
        self.writing_paused = False
        self.eof = False
        self.lost = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None  # a receive waiting for data
        self.drain_waiters: list[asyncio.Future[None]] = []  # sends waiting for buffer room

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.unread += len(data)
        if self.unread > HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport: Redis never half-closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.error = exc
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiters, self.drain_waiters = self.drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncioStream(anyio.abc.ByteStream):
    """See the module's docstring."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        protocol = self._protocol
        chunks = protocol.chunks
        while not chunks:
            if self._closed:
                raise anyio.ClosedResourceError
            if protocol.error is not None:
                raise anyio.BrokenResourceError from protocol.error
            if protocol.eof or protocol.lost:
                raise anyio.EndOfStream
            if protocol.waiter is not None:
                raise anyio.BusyResourceError("reading from")
            protocol.waiter = waiter = protocol.loop.create_future()
            try:
                await waiter
            finally:
                if protocol.waiter is waiter:
                    protocol.waiter = None
        chunk = chunks.popleft()
        if len(chunk) > max_bytes:
            chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
            chunks.appendleft(rest)
        protocol.unread -= len(chunk)
        if protocol.reading_paused and protocol.unread < LOW_WATER and not protocol.lost:
            protocol.reading_paused = False
            self._transport.resume_reading()
        return chunk

    async def send(self, item: bytes) -> None:
        protocol = self._protocol
        if self._closed:
            raise anyio.ClosedResourceError
        if protocol.lost or self._transport.is_closing():
            raise anyio.BrokenResourceError from protocol.error
        self._transport.write(item)
        while protocol.writing_paused and not protocol.lost:
            waiter = protocol.loop.create_future()
            protocol.drain_waiters.append(waiter)
            await waiter
        if protocol.lost and protocol.error is not None:
            raise anyio.BrokenResourceError from protocol.error

    async def send_eof(self) -> None:
        self._transport.write_eof()

    async def aclose(self) -> None:
        self._closed = True
        self._transport.abort()
        self._protocol._wake()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sock = self._transport.get_extra_info("socket")
        return {anyio.abc.SocketAttribute.raw_socket: lambda: sock}


async def open_asyncio_stream(host: str, port: int, path: str | None) -> AsyncioStream:
    """Connect to ``path`` (a Unix socket) or ``host:port``; on the running asyncio loop."""
    loop = asyncio.get_running_loop()
    transport: asyncio.BaseTransport
    if path is not None:
        transport, protocol = await loop.create_unix_connection(lambda: _Protocol(loop), path)
    else:
        transport, protocol = await loop.create_connection(
            lambda: _Protocol(loop), host, port, family=socket.AF_UNSPEC
        )
    assert isinstance(transport, asyncio.Transport)
    return AsyncioStream(transport, protocol)
