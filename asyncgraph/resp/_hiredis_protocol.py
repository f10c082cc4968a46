"""The RESP2 protocol by hiredis's C parser and encoder, within the Python parser's limits;
and the choice between the two, made once, at import (hiredis comes with the ``fleet``
extra, not with ``pip install asyncgraph``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph.resp._protocol import MORE, Arg, Oversize, Reader, Wide, encode

try:
    import hiredis

    _HAVE_HIREDIS = True
except ImportError:  # pragma: no cover - a dependency wherever it has wheels (CPython)
    _HAVE_HIREDIS = False

__all__ = ["new_reader", "pack"]


# A reply under this many bytes is parsed whole by hiredis; a longer one by Reader.
_HIREDIS_REPLY_LIMIT = 512 * 1024
# An array header of a million items or more (or those bytes inside a bulk string):
# Reader reads that reply, skipping what is over the call's limits as it arrives;
# hiredis would allocate the whole list at the header.
_HUGE_ARRAY = re.compile(rb"\*[0-9]{7}")


class _HiredisReader:
    """``Reader``'s face and limits, with hiredis's C parser doing the parsing.

    hiredis parses a stream read far faster than Python does, but
    it buffers a reply whole before returning it, and allocates an array at its header.
    So it gets a reply only while the reply is small: one that grows past
    ``_HIREDIS_REPLY_LIMIT`` bytes, or announces an array of a million items, is handed
    with its bytes so far to a ``Reader``, which reads it to the end skipping what is
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
        self._python: Reader | None = None  # reading a reply too big for hiredis

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
        """Hand the reply being read (and what follows it) to a ``Reader``."""
        python = Reader()
        python.feed(b"".join(self._fed) + chunk)
        for _ in range(self._returned):  # replies hiredis returned already: read them again
            if python.next_reply() is MORE:  # pragma: no cover - hiredis returned them whole
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
        if value is MORE:
            if self._fed_size > _HIREDIS_REPLY_LIMIT:
                self._to_python()
                return self._next_from_python(self._python)  # type: ignore[arg-type]
            return MORE
        size = self._fed_size  # at least this reply's size
        if self._hiredis.has_data():
            self._returned += 1
        else:
            self._fed, self._fed_size, self._returned = [], 0, 0
        cap, max_items = self.cap, self.max_items
        if (cap is not None and size > cap) or (max_items is not None and size > 3 * max_items):
            return _limited(value, cap, max_items)
        return value

    def _next_from_python(self, python: Reader) -> Any:
        python.cap, python.max_items = self.cap, self.max_items
        value = python.next_reply()
        if value is not MORE:  # back to hiredis with what follows the reply
            self._python = None
            self._hiredis = _new_hiredis()
            rest = bytes(python.buf[python.pos :])
            if rest:
                self.feed(rest)
        return value


def _limited(value: Any, cap: int | None, max_items: int | None) -> Any:
    """``value`` with Reader's limits applied (what hiredis returned whole)."""
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


def _new_hiredis() -> Any:
    return hiredis.Reader(replyError=ReplyError, notEnoughData=MORE)


def _hiredis_protocol_error() -> type[Exception]:
    return hiredis.ProtocolError


def new_reader() -> Reader | _HiredisReader:
    """A reply parser for one connection: hiredis's where it is installed."""
    return _HiredisReader() if _HAVE_HIREDIS else Reader()


def pack(commands: Sequence[Sequence[Arg]]) -> bytes:
    """The commands in RESP: by hiredis's C encoder when it takes their arguments."""
    out: list[bytes] = []
    if _HAVE_HIREDIS:
        pack_command = hiredis.pack_command
        for command in commands:
            try:
                out.append(pack_command(tuple(command)))  # type: ignore[arg-type]  # its stub: 1-tuples
            except TypeError:  # e.g. a bool (an int here)
                encode(command, out)
    else:
        for command in commands:
            encode(command, out)
    return b"".join(out)
