"""What a worker's parts share: one small context, made once by ``Worker`` and handed to each.

The parts (intake, membership, cancellations, the reply writer, the tasks) read the
state they need from it (``ctx.slots.free``, ``ctx.slots.held``,
``ctx.stopping.draining``) rather than calling back into ``Worker``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._config import WorkerConfig
from asyncgraph.distributed.worker._metrics import Metrics, worker_metrics
from asyncgraph.distributed.worker._redis_health import RedisHealth
from asyncgraph.distributed.worker._slots import Slots
from asyncgraph.resp import Pool, parse_redis_url

__all__ = ["Stopping", "WorkerContext"]


class Stopping:
    """Whether the worker drains, and the cancel scopes a drain cancels.

    ``drain()`` may come before the scopes exist (before ``serve``, or while connecting):
    a scope opened after it starts cancelled.
    """

    def __init__(self) -> None:
        self.draining = False
        self._scopes: set[anyio.CancelScope] = set()

    @contextmanager
    def scope(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that a drain cancels (reading tasks, connecting to Redis)."""
        with anyio.CancelScope() as scope:
            if self.draining:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def drain(self) -> None:
        """Stop taking tasks: cancel every open ``scope()``, and those opened later."""
        self.draining = True
        for scope in self._scopes:
            scope.cancel()


@dataclass(frozen=True, eq=False)
class WorkerContext:
    """One worker's settings, connections and shared state (``new`` makes one from settings)."""

    config: WorkerConfig
    consumer: str  # its name in the consumer group
    pool: Pool
    signer: Signer
    health: RedisHealth
    metrics: Metrics
    slots: Slots
    stopping: Stopping

    @classmethod
    def new(
        cls, config: WorkerConfig, *, too_many_abandoned: Callable[[], None] = lambda: None
    ) -> WorkerContext:
        """A context for ``config``; nothing connects until a part uses the pool.

        ``too_many_abandoned``: called when a call is abandoned beyond ``max_abandoned``
        (``Slots``).
        """
        consumer = config.consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        metrics = worker_metrics()
        return cls(
            config,
            consumer,
            Pool(parse_redis_url(config.redis_url), timeout_s=config.redis_timeout_s),
            Signer(config.secret),
            RedisHealth(consumer, metrics),
            metrics,
            Slots(
                config.concurrency,
                metrics,
                config.max_abandoned,
                too_many_abandoned=too_many_abandoned,
            ),
            Stopping(),
        )
