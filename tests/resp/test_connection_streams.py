"""The lean byte streams under asyncgraph.resp's connections (``_asyncio_stream``, ``_trio_stream``)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from functools import partial

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
def anyio_backend() -> str:
    return "asyncio"


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
        await anyio.sleep(0.3)  # the server has written all it can
        assert protocol.reading_paused
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


async def test_a_cancelled_receive_leaves_nothing_waiting(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    with anyio.move_on_after(0.05):
        await stream.receive()
    assert stream._protocol.waiter is None  # type: ignore[attr-defined]
    await stream.send(b"ping")
    assert await stream.receive() == b"ping"
    await stream.aclose()


async def test_two_readers_at_once_are_refused(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.receive)
        await anyio.sleep(0.01)
        with pytest.raises(anyio.BusyResourceError):
            await stream.receive()
        tg.cancel_scope.cancel()
    await stream.aclose()


async def test_connecting_nowhere_is_an_os_error() -> None:
    from asyncgraph.distributed._redis_server import free_port

    with pytest.raises(OSError):
        await open_asyncio_stream("127.0.0.1", free_port(), None)


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


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_connections_use_the_lean_stream_of_their_event_loop(
    redis_url: str, anyio_backend: str
) -> None:
    from asyncgraph.resp._trio_stream import TrioStream

    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        lean = AsyncioStream if anyio_backend == "asyncio" else TrioStream
        assert isinstance(conn._stream, lean)
        assert await conn.execute("PING") == b"PONG"
        await conn.aclose()
    finally:
        await pool.aclose()


async def test_waits_past_the_deadline_raise_timeout_error(echo: int) -> None:
    stream = await open_asyncio_stream("127.0.0.1", echo, None)
    assert isinstance(stream, AsyncioStream)
    stream.deadline = stream.time() + 0.05
    with pytest.raises(TimeoutError):
        await stream.receive()  # nothing comes
    assert stream._protocol.waiter is None
    stream.deadline = None
    await stream.send(b"still usable")
    assert await stream.receive() == b"still usable"
    await stream.aclose()


async def test_a_send_that_waits_for_room_past_the_deadline_raises_timeout_error() -> None:
    """A peer that never reads: the kernel's buffers fill, then the transport's."""
    stalled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stalled.wait()
        writer.close()

    server, port = await _serve(handle)
    async with server:
        stream = await open_asyncio_stream("127.0.0.1", port, None)
        assert isinstance(stream, AsyncioStream)
        stream.deadline = stream.time() + 0.2
        with pytest.raises(TimeoutError):
            for _ in range(1000):
                await stream.send(b"x" * 1_000_000)
        assert stream._protocol.writing_paused
        stalled.set()
        await stream.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_command_past_its_timeout_raises_timeout_error_and_closes_the_connection(
    redis_url: str,
) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        started = anyio.current_time()
        with pytest.raises(TimeoutError):
            await conn.execute("BLPOP", "nothing:here", 5, timeout_s=0.1)
        assert anyio.current_time() - started < 2
        assert conn.broken
        assert await pool.execute("PING", timeout_s=1) == b"PONG"
    finally:
        await pool.aclose()


# -- trio -------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_stream_sends_receives_ends_and_times_out() -> None:
    import trio

    from asyncgraph.resp._trio_stream import TrioStream, open_trio_stream

    async def echo(stream: trio.SocketStream) -> None:
        async for data in stream:
            if data == b"bye":
                await stream.aclose()
                return
            await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        stream = await open_trio_stream("127.0.0.1", port, None)
        assert isinstance(stream, TrioStream)
        await stream.send(b"hello world")
        assert await receive_in_chunks_of_4(stream, 11) == b"hello world"
        assert stream.extra(anyio.abc.SocketAttribute.raw_socket).family == socket.AF_INET

        stream.deadline = stream.time() + 0.05
        with pytest.raises(TimeoutError):
            await stream.receive()  # nothing comes
        stream.deadline = None

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.receive)
            await anyio.sleep(0.01)
            with pytest.raises(anyio.BusyResourceError):
                await stream.receive()
            tg.cancel_scope.cancel()

        await stream.send(b"bye")
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()
        await stream.aclose()
        with pytest.raises(anyio.ClosedResourceError):
            await stream.send(b"x")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_stream_yields_once_a_request_even_when_the_reply_is_already_there() -> None:
    import socketserver
    import threading
    import time

    import trio

    from asyncgraph.resp._trio_stream import open_trio_stream

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(65536):
                self.request.sendall(data)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        block_on_close = False

    # A server on another thread: it answers while this loop is blocked.
    with Server(("127.0.0.1", 0), Echo) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stream = await open_trio_stream("127.0.0.1", server.server_address[1], None)
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        events: list[str] = []

        async def request() -> None:
            await stream.send(b"ping")  # the socket has room: no wait
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # block the loop until the echo is there
                try:
                    if sock.recv(4, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    time.sleep(0.001)  # noqa: ASYNC251 (blocking the loop is the point)
            assert await stream.receive() == b"ping"
            events.append("reply")

        async def other() -> None:
            events.append("other")

        # Started together (one scheduler batch, in either order): the request yields
        # once, so the other task runs before the reply is returned.
        for _ in range(10):
            events.clear()
            async with trio.open_nursery() as batch:
                batch.start_soon(request)
                batch.start_soon(other)
            assert events == ["other", "reply"]
        await stream.aclose()
        server.shutdown()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_stream_closed_while_a_task_waits_on_it() -> None:
    import trio

    from asyncgraph.resp._trio_stream import open_trio_stream

    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
        stream = await open_trio_stream("127.0.0.1", listener.socket.getsockname()[1], None)
        failed: list[BaseException] = []

        async def reader() -> None:
            try:
                await stream.receive()
            except anyio.ClosedResourceError as exc:
                failed.append(exc)

        nursery.start_soon(reader)
        await anyio.sleep(0.02)
        await stream.aclose()
        await anyio.sleep(0.02)
        assert len(failed) == 1
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_stream_over_unix_sockets_and_nowhere() -> None:
    import trio

    from asyncgraph.distributed._redis_server import free_port
    from asyncgraph.resp._trio_stream import open_trio_stream

    with pytest.raises(OSError):
        await open_trio_stream("127.0.0.1", free_port(), None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s")
        sock = trio.socket.socket(socket.AF_UNIX)
        await sock.bind(path)
        sock.listen()

        async def serve() -> None:
            conn, _ = await sock.accept()
            await conn.send(await conn.recv(100))
            conn.close()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            stream = await open_trio_stream("unused", 0, path)
            await stream.send(b"over unix")
            assert await stream.receive() == b"over unix"
            await stream.aclose()
        sock.close()
