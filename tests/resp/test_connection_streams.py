"""The byte streams under asyncgraph.resp's connections.

anyio's (``anyio.connect_tcp`` / ``anyio.connect_unix``) on every event loop, but one
branch: plain sockets on asyncio use ``_asyncio_stream`` (see "Per-loop branches kept"
in docs/guide/architecture.md). A call's deadline is an ``anyio.fail_after`` on both.
"""

from __future__ import annotations

import asyncio
import os
import socket
import socketserver
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.abc
import pytest

from asyncgraph.resp import Pool, parse_redis_url
from asyncgraph.resp._asyncio_stream import (
    HIGH_WATER,
    LOW_WATER,
    AsyncioStream,
    open_asyncio_stream,
)

pytestmark = pytest.mark.anyio


class _Pong(socketserver.BaseRequestHandler):
    """Answers every read with one ``+PONG`` (a client sending one PING at a time)."""

    def handle(self) -> None:
        while self.request.recv(65536):
            self.request.sendall(b"+PONG\r\n")


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False


@pytest.fixture
def unix_pong() -> Iterator[str]:
    """The path of a Unix socket served by ``_Pong`` on a thread of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "redis.sock")
        with _UnixServer(path, _Pong) as server:
            threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
            ).start()
            try:
                yield path
            finally:
                server.shutdown()


async def test_connections_use_the_asyncio_stream_or_anyios_with_keepalive(
    redis_url: str, anyio_backend: str
) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        kind = AsyncioStream if anyio_backend == "asyncio" else anyio.abc.SocketStream
        assert isinstance(conn._stream, kind)
        sock = conn._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert await conn.execute("PING") == b"PONG"
        await conn.aclose()
    finally:
        await pool.aclose()


async def test_unix_socket_urls_connect(unix_pong: str) -> None:
    pool = Pool(parse_redis_url(f"unix://{unix_pong}"), timeout_s=5)
    try:
        conn = await pool.connect()
        sock = conn._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        assert sock.family == socket.AF_UNIX
        assert await conn.execute("PING") == b"PONG"
        assert await pool.execute("PING") == b"PONG"
        await conn.aclose()
    finally:
        await pool.aclose()


async def test_a_command_past_its_timeout_raises_timeout_error_and_closes_the_connection(
    redis_url: str,
) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        with pytest.raises(TimeoutError):  # its timeout (the BLPOP's 120 s answers nil)
            await conn.execute("BLPOP", "nothing:here", 120, timeout_s=0.1)
        assert conn.broken
        assert await pool.execute("PING", timeout_s=1) == b"PONG"
    finally:
        await pool.aclose()


async def test_a_command_lets_other_tasks_run_even_when_its_reply_is_fast(redis_url: str) -> None:
    # Tasks submitting in one tick must each yield, so that they join one batch (the
    # executor's flusher) and a loop of fast commands never starves the other tasks.
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        events: list[str] = []

        async def request() -> None:
            for _ in range(20):
                await conn.execute("PING")
            events.append("requests done")

        async def other() -> None:
            events.append("other")

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            tg.start_soon(other)
        assert events == ["other", "requests done"]
        await conn.aclose()
    finally:
        await pool.aclose()


# -- the asyncio stream -------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    return server, port


async def receive_in_chunks_of_4(stream: anyio.abc.ByteReceiveStream, size: int) -> bytes:
    """``size`` bytes read with ``receive(4)``, checking that no read exceeds 4 bytes."""
    got = b""
    while len(got) < size:
        chunk = await stream.receive(4)
        assert 0 < len(chunk) <= 4
        got += chunk
    return got


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server, port = await _serve(handle)
    async with server:
        yield port


asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@asyncio_only
async def test_sends_at_once_and_receives_in_order_within_max_bytes(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    try:
        await stream.send(b"hello ")
        await stream.send(b"world")
        assert await receive_in_chunks_of_4(stream, 11) == b"hello world"
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        assert sock.family == socket.AF_INET
    finally:
        await stream.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"x")


@asyncio_only
async def test_a_peer_that_closes_ends_the_stream_after_its_last_bytes() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"bye")
        await writer.drain()
        writer.close()

    server, port = await _serve(handle)
    async with server:
        stream = await open_asyncio_stream("127.0.0.1", port, None)
        assert await stream.receive() == b"bye"
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()
        await stream.aclose()


@asyncio_only
async def test_unread_bytes_stay_bounded_and_reading_resumes_as_they_are_taken() -> None:
    """Past HIGH_WATER unread bytes the socket is not read; below LOW_WATER it is again."""
    size = 6 * HIGH_WATER

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(os.urandom(16) * (size // 16))
        await writer.drain()
        writer.close()

    server, port = await _serve(handle)
    async with server:
        stream = await open_asyncio_stream("127.0.0.1", port, None)
        protocol = stream._protocol  # type: ignore[attr-defined]
        with anyio.fail_after(60):  # a deadline: the server writes all it can, then pauses
            while not protocol.reading_paused:  # noqa: ASYNC110 (the protocol's flag)
                await anyio.sleep(0.01)
        assert protocol.unread <= HIGH_WATER + 262_144  # one read past the mark at most
        total = 0
        try:
            while True:
                total += len(await stream.receive(65536))
                assert protocol.unread <= HIGH_WATER + 262_144
        except anyio.EndOfStream:
            pass
        assert total == size
        assert not protocol.reading_paused and protocol.unread == 0
        assert LOW_WATER < HIGH_WATER
        await stream.aclose()


@asyncio_only
async def test_a_cancelled_receive_leaves_nothing_waiting(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    with anyio.move_on_after(0.05):
        await stream.receive()
    assert stream._protocol.waiter is None  # type: ignore[attr-defined]
    await stream.send(b"ping")
    assert await stream.receive() == b"ping"
    await stream.aclose()


@asyncio_only
async def test_two_readers_at_once_are_refused(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.receive)
        await anyio.sleep(0.01)
        with pytest.raises(anyio.BusyResourceError):
            await stream.receive()
        tg.cancel_scope.cancel()
    await stream.aclose()


@asyncio_only
async def test_connecting_nowhere_is_an_os_error() -> None:
    from asyncgraph.distributed._redis_server import free_port

    with pytest.raises(OSError):
        await open_asyncio_stream("127.0.0.1", free_port(), None)


@asyncio_only
async def test_unix_sockets_too() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s")

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.read(100))
            await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(handle, path)  # type: ignore[arg-type]
        async with server:
            stream = await open_asyncio_stream("unused", 0, path)
            await stream.send(b"over unix")
            assert await stream.receive() == b"over unix"
            await stream.aclose()
