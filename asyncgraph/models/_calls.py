"""``observe_calls``: a record of every model call, for logs, traces and dashboards.

The models package knows nothing of graphs or traces: it only tells the observers
installed with ``observe_calls`` (a contextvar, like ``track_usage``) about each call
made in their context, as a ``ModelCall``. Whoever installs an observer decides what a
call belongs to (``asyncgraph.observe`` asks the engine which node is running).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = [
    "CallObserver",
    "ModelCall",
    "call_slot",
    "limit_calls",
    "notify_call",
    "observe_calls",
    "observing_calls",
]

logger = logging.getLogger("asyncgraph.models")


@dataclass(frozen=True)
class ModelCall:
    """One ``complete()`` call of a ``BaseChatModel``, as its observers see it.

    ``request`` is what the client sends or would send, as JSON data (the request body
    or ``cache_request``: messages and params, the client's defaults included; never
    headers, so never an API key). ``reply`` is the answer's text (None when the call
    failed, ``error`` then says why). ``started_s`` is ``time.perf_counter()`` at the
    start, ``started_at`` the wall clock (``time.time()``), ``latency_s`` the whole
    call: rate-limit waits, every attempt and the backoffs between them. ``attempts``:
    1 when the first attempt answered (0 for a cache hit); ``retries`` is
    ``attempts - 1``, and ``retried_after`` names the error of each retried attempt, in
    order (``("ModelTimeoutError",)``: the first attempt timed out, the second
    answered). ``cost_usd`` is None when the model has no ``Pricing``.
    ``cache_read_tokens`` / ``cache_write_tokens``: the part of ``prompt_tokens`` the
    provider read from / wrote to its prompt cache (see ``Completion``).

    Example::

        calls = []
        with observe_calls(calls.append):
            await model.complete([{"role": "user", "content": "Hi"}])
        print(calls[0].model, calls[0].latency_s, calls[0].attempts, calls[0].cost_usd)
    """

    model: str
    endpoint: str
    request: Mapping[str, Any]
    reply: str | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None
    started_s: float
    started_at: float
    latency_s: float
    cached: bool
    attempts: int
    finish_reason: str | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    retried_after: tuple[str, ...] = ()

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


CallObserver = Callable[[ModelCall], object]

_OBSERVERS: contextvars.ContextVar[tuple[CallObserver, ...]] = contextvars.ContextVar(
    "asyncgraph_call_observers", default=()
)


@contextmanager
def observe_calls(observer: CallObserver) -> Iterator[None]:
    """Call ``observer(call)`` with a ``ModelCall`` after every model call in the block.

    Covers every ``BaseChatModel.complete`` made in this task and the tasks it starts
    while the block is open, answered, cached or failed. The observer runs in the task
    that made the call (so it can read that task's contextvars) and must be quick; one
    that raises is logged and ignored. Blocks nest::

        calls = []
        with observe_calls(calls.append):
            await model.complete([{"role": "user", "content": "Hi"}])
        print(calls[0].latency_s, calls[0].total_tokens)
    """
    if not callable(observer):
        raise TypeError(f"observe_calls expects a callable taking a ModelCall, got {observer!r}")
    token = _OBSERVERS.set((*_OBSERVERS.get(), observer))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def observing_calls() -> bool:
    """True when some ``observe_calls`` block is open in this context."""
    return bool(_OBSERVERS.get())


def notify_call(call: ModelCall) -> None:
    """Give ``call`` to every observer of this context (errors logged, never raised)."""
    for observer in _OBSERVERS.get():
        try:
            observer(call)
        except Exception:  # an observer must not cost the caller its answer
            logger.exception("model call observer %r raised", observer)


_SLOTS: contextvars.ContextVar[anyio.Semaphore | None] = contextvars.ContextVar(
    "asyncgraph_call_slots", default=None
)


@contextmanager
def limit_calls(slots: anyio.Semaphore) -> Iterator[None]:
    """Make every ``BaseChatModel.complete`` of this context (and of the tasks it starts)
    that reaches its provider hold one of ``slots`` for the length of the call (rate-limit
    waits and retries included; cache hits take none). For a caller that bounds all the
    model calls of its work, whichever objects make them (``ParetoSearch``). The inner
    block wins when blocks nest."""
    token = _SLOTS.set(slots)
    try:
        yield
    finally:
        _SLOTS.reset(token)


@asynccontextmanager
async def call_slot() -> AsyncIterator[None]:
    """Hold a slot of the ``limit_calls`` block around a call, if one is open. Inside, no
    block is open: a model calling another model in its call takes one slot, not two
    (which could wait forever)."""
    slots = _SLOTS.get()
    if slots is None:
        yield
        return
    async with slots:
        token = _SLOTS.set(None)
        try:
            yield
        finally:
            _SLOTS.reset(token)
