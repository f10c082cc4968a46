"""A small async Redis client (RESP2): same code on asyncio and trio.

It reads and writes anyio's socket streams (``anyio.connect_tcp``, with TLS or
without, and ``anyio.connect_unix``), and a deadline per call is an
``anyio.fail_after``, on every event loop anyio runs on; but plain sockets on
asyncio, which get the one stream of its own (``_asyncio_stream``: the one
per-loop branch kept for speed, listed in docs/guide/architecture.md).

Why not redis-py: its asyncio client does not run under trio, and its
synchronous client in worker threads costs a thread hop on every call and on every
wake-up of a blocking read: several of them per remote node, a large part of a round
trip's budget (docs/guide/benchmarks.md has the measurement that chose this client). This client speaks just what the worker protocol needs:
commands, pipelines (one write, N replies), blocking reads that a cancel scope
interrupts at once. redis-py is still used to parse URLs (their options are checked
by ``_url_options``: see NOTE [Redis URL options]).

Every call has a deadline (``timeout_s``); a connection that saw a timeout, a
cancellation or a protocol error mid-command is closed, never reused. A pooled
connection that fails mid-call gets the commands sent again on a new one only when
a repeat is harmless (``Pool.pipeline``'s ``retry``, and ``_idempotence``). Errors:
``RedisConnectionLost`` (also ``ConnectionError``) for anything network,
``ReplyError`` for an error reply of the server.

A call may cap what it accepts (``max_bulk``): a bulk string longer than that is
not read into memory but skipped as it arrives and replaced by ``Oversize(size)``
in the reply (the connection stays usable); an array longer than that is a
protocol error, and one of more than ``max_items`` items is skipped the same way and
replaced by ``Wide(count)``. The parser is incremental: linear in the bytes received. Readers of streams that anyone may write to (task and reply
streams) set it from their message limit, so one huge entry cannot exhaust memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

import anyio
import anyio.abc
import anyio.lowlevel

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph._redact import redact_url
from asyncgraph.resp._asyncio_stream import open_asyncio_stream
from asyncgraph.resp._idempotence import unsafe_command
from asyncgraph.resp._url_options import tls_context, url_options

if TYPE_CHECKING:
    from asyncgraph.resp._cluster import ClusterRouter

__all__ = [
    "Connection",
    "Wide",
    "Oversize",
    "Pool",
    "RedisAddress",
    "RedisConnectionLost",
    "ReplyError",
    "parse_redis_url",
    "redact_url",
]

Arg = bytes | str | int | float
_RECV = 262_144
_NO_SCOPE = nullcontext()
_SMALL_ARG = 4096  # arguments shorter than this are formatted into their header


@dataclass(frozen=True)
class RedisAddress:
    """Where and how to connect; from ``parse_redis_url``."""

    display: str
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr or a log
    ssl_context: ssl.SSLContext | None = None
    # redis+sentinel://: the sentinels to ask for the master of ``service`` (host and port
    # above are unused then), and the sentinels' own password if they have one.
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    # redis+cluster://: some nodes of a Redis Cluster (the seeds); host and port are unused.
    cluster: tuple[tuple[str, int], ...] = ()


URL_SCHEMES = (
    "redis://, rediss:// (TLS), unix://, redis+sentinel://, redis+cluster://, rediss+cluster://"
)


def parse_redis_url(url: str) -> RedisAddress:
    """``redis://[user:pass@]host[:port][/db]``, ``rediss://...`` (TLS, ``?ssl_cert_reqs=``
    ``none|optional|required``, ``ssl_ca_certs=``, ``ssl_ca_path=``, ``ssl_certfile=``,
    ``ssl_keyfile=``, ``ssl_password=``, ``ssl_check_hostname=``),
    ``unix:///path?db=N``, ``redis+sentinel://[user:pass@]host:port[,host:port...]/SERVICE[/db]``
    (``?sentinel_password=``; the password is the master's), or
    ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://`` with the
    TLS options above): some nodes of a Redis Cluster. ``?password=`` and ``?username=``
    as well, but not on Sentinel. Raise ``ValueError`` for anything else: an option the scheme does
    not honour (a TLS option on ``redis://``, any on ``redis+sentinel://``), one it does
    not know, a TLS file that cannot be read (see NOTE [Redis URL options]).

    Example::

        address = parse_redis_url("redis://:secret@127.0.0.1:6380/2")
        print(address.host, address.port, address.db, address.display)   # 127.0.0.1 6380 2 redis://:***@...
    """
    if url.startswith("redis+sentinel://"):
        return _parse_sentinel_url(url)
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        return _parse_cluster_url(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: it must start with one of {URL_SCHEMES}"
        )
    return _parse_one(url, url)


def _url_parts(url: str) -> dict[str, Any]:
    """Host, port, socket path, db and credentials of a ``redis://``, ``rediss://`` or
    ``unix://`` URL, read as redis-py's ``parse_url`` reads them (percent-decoded; the db
    from ``?db=`` or else the path), without importing redis-py: ``asyncgraph worker
    --help`` and every worker start parse a URL, and redis-py costs tens of milliseconds
    to import. The query's other options are ``url_options``'."""
    parts = urlsplit(url)
    kw: dict[str, Any] = {}
    query = parse_qs(parts.query)
    for name in ("username", "password"):  # the userinfo's, when given, win
        if query.get(name):
            kw[name] = query[name][0]
    if query.get("db"):
        try:
            kw["db"] = int(query["db"][0])
        except ValueError:
            raise ValueError("Invalid value for 'db' in connection URL.") from None
    if parts.username:
        kw["username"] = unquote(parts.username)
    if parts.password:
        kw["password"] = unquote(parts.password)
    if parts.scheme == "unix":
        if parts.path:
            kw["path"] = unquote(parts.path)
        return kw
    if parts.hostname:
        kw["host"] = unquote(parts.hostname)
    if parts.port:  # ValueError for a port out of range or not a number
        kw["port"] = int(parts.port)
    if parts.path and "db" not in kw:
        with contextlib.suppress(ValueError):
            kw["db"] = int(unquote(parts.path).replace("/", ""))
    return kw


def _parse_one(url: str, shown: str) -> RedisAddress:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL; errors name ``shown`` (the URL
    the user wrote, of which ``url`` may be one node)."""
    scheme = url.split("://", 1)[0]
    options = url_options(shown, scheme, urlsplit(url).query)
    try:
        kw = _url_parts(url)
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {redact_url(shown)!r}: {exc}") from None
    return RedisAddress(
        display=redact_url(url),
        host=kw.get("host", "127.0.0.1"),
        port=int(kw.get("port", 6379)),
        path=kw.get("path"),
        db=int(kw.get("db", 0) or 0),
        username=kw.get("username"),
        password=kw.get("password"),
        ssl_context=tls_context(shown, options) if scheme == "rediss" else None,
    )


def _parse_sentinel_url(url: str) -> RedisAddress:
    from urllib.parse import unquote

    parts = urlsplit(url)
    sentinels = _host_ports(url, parts.netloc)
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: expected "
            f"redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/db]"
        )
    options = url_options(url, "redis+sentinel", parts.query)
    return RedisAddress(
        display=redact_url(url).split("?", 1)[0],  # no sentinel_password
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        sentinels=tuple(sentinels),
        service=path[0],
        sentinel_password=options.get("sentinel_password"),
    )


def _host_ports(url: str, netloc: str) -> list[tuple[str, int]]:
    nodes = []
    for item in filter(None, netloc.rsplit("@", 1)[-1].split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"invalid Redis URL {redact_url(url)!r}: each node must be host:port, got {item!r}"
            )
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def _parse_cluster_url(url: str) -> RedisAddress:
    scheme, rest = url.split("+cluster://", 1)
    rest, _, query = rest.partition("?")
    netloc, _, db = rest.partition("/")
    nodes = _host_ports(url, netloc)
    if not nodes or db not in ("", "0"):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: expected "
            f"{scheme}+cluster://[user:password@]host:port[,host:port...] (a cluster has "
            f"database 0 only)"
        )
    url_options(url, f"{scheme}+cluster", query)  # what the cluster scheme takes
    # Credentials and TLS options as for one node (the first).
    userinfo = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
    host, port = nodes[0]
    one = _parse_one(f"{scheme}://{userinfo}{host}:{port}/0" + (f"?{query}" if query else ""), url)
    return replace(one, display=redact_url(url).split("?", 1)[0], cluster=tuple(nodes))


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


def _encode(args: Sequence[Arg], out: list[bytes]) -> None:
    out.append(b"*%d\r\n" % len(args))
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(float(arg)).encode()
        if len(data) < _SMALL_ARG:
            out.append(b"$%d\r\n%b\r\n" % (len(data), data))
        else:  # not copied once more here
            out += (b"$%d\r\n" % len(data), data, b"\r\n")


@dataclass(frozen=True, slots=True)
class Oversize:
    """Stands for a bulk string longer than the call's ``max_bulk``: skipped, never read.

    Example::

        await pool.execute("SET", "greeting", "hello " * 100)
        print(await pool.execute("GET", "greeting", max_bulk=16))    # Oversize(size=600)
    """

    size: int


@dataclass(frozen=True, slots=True)
class Wide:
    """Stands for an array of more than the call's ``max_items`` items: skipped, never built.

    Example::

        await pool.execute("RPUSH", "items", *range(10))
        print(await pool.execute("LRANGE", "items", 0, -1, max_items=5))    # Wide(count=10)
    """

    count: int


class _Frame:
    """An array being read: its items so far (None while skipped), how many are still to come."""

    __slots__ = ("count", "items", "left")

    def __init__(self, count: int, items: list[Any] | None) -> None:
        self.count = count
        self.items = items
        self.left = count


class _Reader:
    """Incremental RESP2 parser: each byte is looked at once, whatever the chunk sizes.

    ``feed`` adds what arrived; ``next_reply`` returns one whole reply or ``_MORE``. The
    arrays being read are kept on a stack between calls (a reply of 400,000 items
    arriving in 256 KiB chunks is parsed once, not once per chunk). A bulk string over
    ``cap`` and every part of an array over ``max_items`` are dropped as they arrive.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0
        self.skip = 0  # bytes still to come of a bulk string being dropped
        self.stack: list[_Frame] = []
        self.cap: int | None = None
        self.max_items: int | None = None

    @property
    def buffered(self) -> int:
        """Bytes held (of replies not yet returned, and some already returned)."""
        return len(self.buf)

    def feed(self, chunk: bytes) -> None:
        if self.skip:
            dropped = min(self.skip, len(chunk))
            self.skip -= dropped
            chunk = chunk[dropped:]
        if self.pos and self.pos == len(self.buf):
            self.buf.clear()
            self.pos = 0
        elif self.pos > _RECV:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += chunk

    def next_reply(self) -> Any:  # noqa: C901 (a RESP parser: one branch per type byte)
        buf, stack = self.buf, self.stack
        while True:
            if self.skip:
                return _MORE
            pos = self.pos
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return _MORE
            kind = buf[pos]
            skipping = bool(stack) and stack[-1].items is None
            if kind == 36:  # $ bulk string
                n = int(buf[pos + 1 : end])
                start = end + 2
                if n < 0:
                    value: Any = None
                    self.pos = start
                elif skipping or (self.cap is not None and n > self.cap):
                    value = Oversize(n)
                    have = len(buf) - start
                    if have >= n + 2:
                        self.pos = start + n + 2
                    else:  # drop what arrived of it, and the rest as it comes
                        del buf[start:]
                        self.pos = start
                        self.skip = n + 2 - have
                else:
                    stop = start + n
                    if len(buf) < stop + 2:
                        return _MORE
                    value = bytes(buf[start:stop])
                    self.pos = stop + 2
            elif kind == 42:  # * array
                n = int(buf[pos + 1 : end])
                self.pos = end + 2
                if n > 0:
                    wide = skipping or (self.max_items is not None and n > self.max_items)
                    if not wide and self.cap is not None and n > self.cap:
                        raise RedisConnectionLost(
                            f"protocol limit: an array of {n} items is above this call's cap "
                            f"of {self.cap}"
                        )
                    stack.append(_Frame(n, None if wide else []))
                    continue
                value = None if n < 0 else []
            elif kind == 58:  # : integer
                value = int(buf[pos + 1 : end])
                self.pos = end + 2
            elif kind == 43:  # + simple string
                value = bytes(buf[pos + 1 : end])
                self.pos = end + 2
            elif kind == 45:  # - error
                value = ReplyError(buf[pos + 1 : end].decode("utf-8", "replace"))
                self.pos = end + 2
            else:
                raise RedisConnectionLost(f"protocol error: unexpected reply type byte {kind!r}")
            # Hand the value to the arrays it completes.
            while stack:
                frame = stack[-1]
                if frame.items is not None:
                    frame.items.append(value)
                frame.left -= 1
                if frame.left:
                    break
                stack.pop()
                value = frame.items if frame.items is not None else Wide(frame.count)
            else:
                return value


_MORE: Any = object()  # next_reply: the reply is not complete yet


# A reply under this many bytes is parsed whole by hiredis; a longer one by _Reader.
_HIREDIS_REPLY_LIMIT = 512 * 1024
# An array header of a million items or more (or those bytes inside a bulk string):
# _Reader reads that reply, skipping what is over the call's limits as it arrives;
# hiredis would allocate the whole list at the header.
_HUGE_ARRAY = re.compile(rb"\*[0-9]{7}")


class _HiredisReader:
    """``_Reader``'s face and limits, with hiredis's C parser doing the parsing.

    hiredis parses a stream read far faster than Python does, but
    it buffers a reply whole before returning it, and allocates an array at its header.
    So it gets a reply only while the reply is small: one that grows past
    ``_HIREDIS_REPLY_LIMIT`` bytes, or announces an array of a million items, is handed
    with its bytes so far to a ``_Reader``, which reads it to the end skipping what is
    over the limits; the next reply goes back to hiredis. A reply that hiredis returns
    gets the limits too: a bulk string over ``cap`` becomes ``Oversize``, an array of
    more than ``max_items`` items ``Wide``, an array over ``cap`` a protocol error.
    """

    def __init__(self) -> None:
        self.cap: int | None = None
        self.max_items: int | None = None
        self._hiredis = _new_hiredis()
        self._fed: list[bytes] = []  # since the last reply boundary that hiredis reached
        self._fed_size = 0
        self._returned = 0  # replies returned since that boundary
        self._tail = b""  # the end of the last chunk (a header cut between two chunks)
        self._python: _Reader | None = None  # reading a reply too big for hiredis

    @property
    def buffered(self) -> int:
        return self._python.buffered if self._python is not None else self._fed_size

    def feed(self, chunk: bytes) -> None:
        if self._python is not None:
            self._python.feed(chunk)
            return
        if _HUGE_ARRAY.search(self._tail + chunk[:16]) or _HUGE_ARRAY.search(chunk):
            self._to_python(chunk)
            return
        self._tail = chunk[-16:]
        self._hiredis.feed(chunk)
        self._fed.append(chunk)
        self._fed_size += len(chunk)

    def _to_python(self, chunk: bytes = b"") -> None:
        """Hand the reply being read (and what follows it) to a ``_Reader``."""
        python = _Reader()
        python.feed(b"".join(self._fed) + chunk)
        for _ in range(self._returned):  # replies hiredis returned already: read them again
            if python.next_reply() is _MORE:  # pragma: no cover - hiredis returned them whole
                raise RedisConnectionLost("protocol error: the reply parsers disagree")
        self._python = python
        self._fed, self._fed_size, self._returned, self._tail = [], 0, 0, b""

    def next_reply(self) -> Any:
        if self._python is not None:
            return self._next_from_python(self._python)
        try:
            value = self._hiredis.gets()
        except _hiredis_protocol_error() as exc:
            raise RedisConnectionLost(f"protocol error: {exc}") from None
        if value is _MORE:
            if self._fed_size > _HIREDIS_REPLY_LIMIT:
                self._to_python()
                return self._next_from_python(self._python)  # type: ignore[arg-type]
            return _MORE
        size = self._fed_size  # at least this reply's size
        if self._hiredis.has_data():
            self._returned += 1
        else:
            self._fed, self._fed_size, self._returned = [], 0, 0
        cap, max_items = self.cap, self.max_items
        if (cap is not None and size > cap) or (max_items is not None and size > 3 * max_items):
            return _limited(value, cap, max_items)
        return value

    def _next_from_python(self, python: _Reader) -> Any:
        python.cap, python.max_items = self.cap, self.max_items
        value = python.next_reply()
        if value is not _MORE:  # back to hiredis with what follows the reply
            self._python = None
            self._hiredis = _new_hiredis()
            rest = bytes(python.buf[python.pos :])
            if rest:
                self.feed(rest)
        return value


def _limited(value: Any, cap: int | None, max_items: int | None) -> Any:
    """``value`` with _Reader's limits applied (what hiredis returned whole)."""
    if type(value) is bytes:
        return Oversize(len(value)) if cap is not None and len(value) > cap else value
    if type(value) is not list:
        return value
    if max_items is not None and len(value) > max_items:
        return Wide(len(value))
    if cap is not None and len(value) > cap:
        raise RedisConnectionLost(
            f"protocol limit: an array of {len(value)} items is above this call's cap of {cap}"
        )
    for i, item in enumerate(value):
        kind = type(item)
        if kind is list or (kind is bytes and cap is not None and len(item) > cap):
            value[i] = _limited(item, cap, max_items)
    return value


try:
    import hiredis

    _HAVE_HIREDIS = True
except ImportError:  # pragma: no cover - a dependency wherever it has wheels (CPython)
    _HAVE_HIREDIS = False


def _new_hiredis() -> Any:
    return hiredis.Reader(replyError=ReplyError, notEnoughData=_MORE)


def _hiredis_protocol_error() -> type[Exception]:
    return hiredis.ProtocolError


def _new_reader() -> _Reader | _HiredisReader:
    return _HiredisReader() if _HAVE_HIREDIS else _Reader()


def _pack(commands: Sequence[Sequence[Arg]]) -> bytes:
    """The commands in RESP: by hiredis's C encoder when it takes their arguments."""
    out: list[bytes] = []
    if _HAVE_HIREDIS:
        pack = hiredis.pack_command
        for command in commands:
            try:
                out.append(pack(tuple(command)))  # type: ignore[arg-type]  # its stub: 1-tuples
            except TypeError:  # e.g. a bool (an int here)
                _encode(command, out)
    else:
        for command in commands:
            _encode(command, out)
    return b"".join(out)


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
        self._reader = _new_reader()
        self.broken = False

    @classmethod
    async def open(cls, address: RedisAddress, timeout_s: float) -> Connection:
        """Connect, authenticate and select the database, all within ``timeout_s``.

        Through sentinels: to the master they name, checked with ``ROLE`` (a master the
        sentinels have not yet demoted after a failover is refused, to ask again).
        """
        if address.sentinels:
            return await cls._open_master(address, timeout_s)
        if address.cluster:
            from asyncgraph.resp._cluster import ClusterRouter

            return await ClusterRouter(address, timeout_s).connect()
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
        the replies are not all in by then (the connection is closed).
        """
        if timeout_s is None:
            return await self._pipeline(commands, max_bulk, max_items)
        with anyio.fail_after(timeout_s):
            return await self._pipeline(commands, max_bulk, max_items)

    async def _pipeline(
        self, commands: Sequence[Sequence[Arg]], max_bulk: int | None, max_items: int | None
    ) -> list[Any]:
        if self.broken:
            raise RedisConnectionLost(f"connection to Redis at {self.address.display} is closed")
        data = _pack(commands)
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
        while True:
            value = reader.next_reply()
            if value is not _MORE:
                return value
            reader.feed(await self._stream.receive(_RECV))

    async def aclose(self) -> None:
        self.broken = True
        await anyio.aclose_forcefully(self._stream)


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
        self.router: ClusterRouter | None = None
        if address.cluster:
            from asyncgraph.resp._cluster import ClusterRouter

            self.router = ClusterRouter(address, timeout_s)

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
            with anyio.fail_after(limit, shield=shield):
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
