"""A plain TCP or Unix-socket byte stream for trio, lean where anyio's (and trio's) is general.

trio makes every socket operation a checkpoint: a ``send`` that went out at once, or
a ``recv`` that found bytes waiting, still yields to the scheduler (a full pass of
the run loop), and anyio wraps that stream in one more layer. For a Redis
connection, which sends a request and then waits for its reply, the only waits
that matter are the ones for the reply. This stream calls the non-blocking
socket directly and waits (``wait_readable`` / ``wait_writable``, which are
checkpoints) only when the socket would block; past ``deadline`` it raises
``TimeoutError``, with a cancel scope around that wait only. It raises what
anyio's streams raise, so the client treats both alike. Only plain sockets: TLS
keeps anyio's stream.

A request and its reply still yield to the scheduler once: a ``receive`` that found
its bytes waiting, with no wait since the last ``send`` (the server answered
before we asked, as a fast Redis on another core can), yields once (a
cancel-shielded checkpoint: the bytes are already taken). Without it a loop of
fast commands would never let another trio task run, and tasks submitting
together would each send on their own instead of joining one batch.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.abc
import trio

from asyncgraph.resp._lean_stream import LeanStream

__all__ = ["TrioStream", "open_trio_stream"]


class TrioStream(LeanStream):
    """See the module's docstring."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._closed = False
        self._reading = False
        self._yielded = True  # since the last send (see the module's docstring)

    def time(self) -> float:
        return trio.current_time()

    async def _wait(self, readable: bool) -> None:
        """Wait until the socket is readable (else writable); until ``deadline`` at most."""
        wait = trio.lowlevel.wait_readable if readable else trio.lowlevel.wait_writable
        self._yielded = True
        try:
            if self.deadline is None:
                await wait(self._sock)
                return
            with trio.move_on_at(self.deadline) as scope:
                await wait(self._sock)
            if scope.cancelled_caught:
                raise TimeoutError()
        except trio.ClosedResourceError:
            raise anyio.ClosedResourceError from None
        except trio.BusyResourceError:
            raise anyio.BusyResourceError("reading from" if readable else "writing to") from None

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._reading:
            raise anyio.BusyResourceError("reading from")
        self._reading = True
        try:
            while True:
                if self._closed:
                    raise anyio.ClosedResourceError
                try:
                    data = self._sock.recv(max_bytes)
                except BlockingIOError:
                    await self._wait(True)
                    continue
                except OSError as exc:
                    raise anyio.BrokenResourceError from exc
                if not data:
                    raise anyio.EndOfStream
                if not self._yielded:
                    self._yielded = True
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return data
        finally:
            self._reading = False

    async def send(self, item: bytes) -> None:
        self._yielded = False
        view = memoryview(item)
        while view:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await self._wait(False)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            view = view[sent:]

    async def send_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._sock)  # a task waiting on it gets ClosedResourceError
        self._sock.close()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sock = self._sock
        return {anyio.abc.SocketAttribute.raw_socket: lambda: sock}


async def open_trio_stream(host: str, port: int, path: str | None) -> TrioStream:
    """Connect to ``path`` (a Unix socket) or ``host:port`` with trio; take the socket over."""
    if path is not None:
        stream = await trio.open_unix_socket(path)
    else:
        stream = await trio.open_tcp_stream(host, port)
    sock = stream.socket
    return TrioStream(socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach()))
