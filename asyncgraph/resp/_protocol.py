"""RESP2 in pure Python: commands encoded, replies parsed incrementally, within limits.

A call may cap what it accepts (``max_bulk``, the parser's ``cap``): a bulk string longer
than that is not read into memory but skipped as it arrives and replaced by
``Oversize(size)`` in the reply (the connection stays usable); an array longer than that
is a protocol error, and one of more than ``max_items`` items is skipped the same way and
replaced by ``Wide(count)``. The parser is incremental: linear in the bytes received.
Readers of streams that anyone may write to (task and reply streams) set it from their
message limit, so one huge entry cannot exhaust memory.

hiredis, where it is installed, does the same faster: ``_hiredis_protocol``, which chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncgraph._exceptions import RedisConnectionLost, ReplyError

__all__ = ["MORE", "RECV", "Arg", "Oversize", "Reader", "Wide", "encode"]

Arg = bytes | str | int | float
RECV = 262_144  # bytes a connection asks its stream for at once
_SMALL_ARG = 4096  # arguments shorter than this are formatted into their header
MORE: Any = object()  # next_reply: the reply is not complete yet


def encode(args: Sequence[Arg], out: list[bytes]) -> None:
    """Append one command, ``args``, to ``out`` in RESP (a bool is an int here)."""
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


class Reader:
    """Incremental RESP2 parser: each byte is looked at once, whatever the chunk sizes.

    ``feed`` adds what arrived; ``next_reply`` returns one whole reply or ``MORE``. The
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
        elif self.pos > RECV:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += chunk

    def next_reply(self) -> Any:  # noqa: C901 (a RESP parser: one branch per type byte)
        buf, stack = self.buf, self.stack
        while True:
            if self.skip:
                return MORE
            pos = self.pos
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return MORE
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
                        return MORE
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
