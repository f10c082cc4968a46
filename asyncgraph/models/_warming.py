"""A prompt cache warmed before a step fans out.

NOTE [Cache warming]: providers cache a prompt's prefix, but a prefix becomes readable
only once a first request with it has been worked on (Anthropic: when its answer begins;
OpenAI: when its answer is done, in practice). A step sends its requests at the same
moment, so without care every one of them misses the cache (and, on Anthropic, every one
pays to write it). So a model whose provider caches (``warm_cache``) sends the first
request of a cacheable prefix alone and holds the others that share it until the
provider can read it; then they read the prefix from the cache. While the first request
runs, ``answer_begins()`` gives it a callback to call when its answer begins: a client
that can see that moment (``AnthropicChat`` streams that one request and calls it at
``message_start``) releases the others then, so warming adds the first answer's time to
first token to a step; any other releases them when the answer is back, one request's
latency. A prefix stays warm for ``WARM_FOR_S`` after its last use (the providers keep it
about five minutes), and a first request that fails before its answer began releases the
others at once (they go, uncached, rather than wait). The others wait at most the
model's ``timeout_s``.

What is cacheable (``marked_prefix_key``, ``leading_prefix_key``): Anthropic caches up to
a ``cache_control`` mark whose prefix is at least 1,024 tokens (2,048 for Haiku models);
OpenAI caches any prompt's prefix of 1,024 tokens or more. The key is a hash of that
prefix (the model's name in it), so requests that share it wait for one another and no
others do.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio

__all__ = ["WARM_FOR_S", "Warming", "answer_begins", "leading_prefix_key", "marked_prefix_key"]

WARM_FOR_S = 300.0
OPENAI_MIN_TOKENS = 1024


# Set while the first request of a prefix runs (in its task): what it calls when its
# answer begins. See NOTE [Cache warming].
_BEGINS: ContextVar[Callable[[], None] | None] = ContextVar(
    "asyncgraph_answer_begins", default=None
)


def answer_begins() -> Callable[[], None] | None:
    """For the request that warms a prefix, what to call once its answer has begun (the
    others sharing the prefix are released); None for any other request."""
    return _BEGINS.get()


@dataclass
class _Entry:
    first: anyio.Event | None  # set when the first request's answer begins or is back; None: warm
    warm_until: float = 0.0


class Warming:
    """One model's prefixes being warmed or warm, in one event loop."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    @asynccontextmanager
    async def request(self, key: str | None, wait_s: float) -> AsyncIterator[None]:
        """Around one request whose cacheable prefix is ``key`` (None: nothing to warm):
        the first of a prefix goes at once, the others wait until its answer begins or is
        back (at most ``wait_s``), a warm one goes at once."""
        if key is None:
            yield
            return
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is not None and entry.first is None and entry.warm_until > now:
            entry.warm_until = now + WARM_FOR_S
            yield
            return
        if entry is not None and entry.first is not None:
            with anyio.move_on_after(wait_s):
                await entry.first.wait()
            yield
            return
        first = anyio.Event()
        self._entries[key] = _Entry(first)
        readable = False

        def begun() -> None:
            nonlocal readable
            if not readable:
                readable = True
                self._entries[key] = _Entry(None, time.monotonic() + WARM_FOR_S)
                first.set()

        # An async context manager's body runs in its caller's context: the request
        # sees ``answer_begins()`` until it is done.
        token = _BEGINS.set(begun)
        try:
            yield
            begun()  # the answer is back: readable now, at the latest
        finally:
            _BEGINS.reset(token)
            if not readable:
                self._entries.pop(key, None)
                first.set()


def _digest(model: str, prefix: Any) -> str:
    text = json.dumps([model, prefix], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def marked_prefix_key(body: Mapping[str, Any], chars_per_token: float) -> str | None:
    """The key of an Anthropic Messages body's cacheable prefix: everything up to its last
    ``cache_control`` mark, if that is at least the model's minimum (1,024 tokens; 2,048
    for Haiku models); else None."""
    blocks: list[Any] = []
    system = body.get("system")
    if isinstance(system, list):
        blocks += [("system", b) for b in system]
    for message in body.get("messages", ()):
        content = message.get("content")
        if isinstance(content, list):
            blocks += [(message.get("role"), b) for b in content]
        else:
            blocks.append((message.get("role"), {"type": "text", "text": content}))
    marks = [
        i for i, (_, b) in enumerate(blocks) if isinstance(b, Mapping) and "cache_control" in b
    ]
    if not marks:
        return None
    prefix = blocks[: marks[-1] + 1]
    chars = sum(len(str(b.get("text", ""))) for _, b in prefix if isinstance(b, Mapping))
    model = str(body.get("model", ""))
    minimum = 2048 if "haiku" in model else 1024
    # Counted erring low here: a prefix too short to cache only costs a wait for nothing.
    if chars / max(chars_per_token, 4.0) < minimum:
        return None
    return _digest(model, prefix)


def leading_prefix_key(
    model: str, messages: Sequence[Mapping[str, Any]], chars_per_token: float
) -> str | None:
    """The key of the first 1,024 tokens of a prompt OpenAI may cache, or None when the
    prompt is shorter."""
    text = "".join(f"\0{m.get('role')}\0{m.get('content')}" for m in messages)
    need = math.ceil(OPENAI_MIN_TOKENS * max(chars_per_token, 4.0))
    if len(text) < need:
        return None
    return _digest(model, text[:need])
