"""The byte streams under asyncgraph.resp's connections: anyio's, on every event loop.

No stream of our own: TCP and Unix sockets are ``anyio.connect_tcp`` /
``anyio.connect_unix`` streams on asyncio and trio alike, and a call's deadline is an
``anyio.fail_after``.
"""

from __future__ import annotations

import os
import socket
import socketserver
import tempfile
import threading
from collections.abc import Iterator

import anyio
import anyio.abc
import pytest

from asyncgraph.resp import Pool, parse_redis_url

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
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                yield path
            finally:
                server.shutdown()


async def test_connections_use_anyio_socket_streams_with_keepalive(redis_url: str) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    try:
        conn = await pool.connect()
        assert isinstance(conn._stream, anyio.abc.SocketStream)
        sock = conn._stream.extra(anyio.abc.SocketAttribute.raw_socket)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert await conn.execute("PING") == b"PONG"
        await conn.aclose()
    finally:
        await pool.aclose()


async def test_unix_socket_urls_connect_through_anyio(unix_pong: str) -> None:
    pool = Pool(parse_redis_url(f"unix://{unix_pong}"), timeout_s=5)
    try:
        conn = await pool.connect()
        assert isinstance(conn._stream, anyio.abc.SocketStream)
        assert conn._stream.extra(anyio.abc.SocketAttribute.family) == socket.AF_UNIX
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
        started = anyio.current_time()
        with pytest.raises(TimeoutError):
            await conn.execute("BLPOP", "nothing:here", 5, timeout_s=0.1)
        assert anyio.current_time() - started < 2
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
