"""How Redis has answered this worker lately: the readiness input, and one warning per outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.resp import RedisConnectionLost, ReplyError

__all__ = ["RedisHealth"]

log = logging.getLogger("asyncgraph.distributed.worker")

_WARN_EVERY_S = 10.0


class RedisHealth:
    """Times of the last good answer and the last lost connection; rate-limited warnings."""

    def __init__(self, consumer: str, metrics: Metrics) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.last_ok = 0.0
        self.last_error = 0.0
        self._last_warning: dict[str, float] = {}

    def ok(self) -> None:
        self.last_ok = time.monotonic()

    def failed(self, doing: str, exc: Exception) -> None:
        self.metrics.inc("asyncgraph_worker_redis_errors_total")
        now = time.monotonic()
        if isinstance(exc, (RedisConnectionLost, TimeoutError)):
            self.last_error = now
        if now - self._last_warning.get(doing, -1e9) >= _WARN_EVERY_S:  # one line per outage
            self._last_warning[doing] = now
            log.warning("worker %s: %s: %s", self.consumer, doing, exc)

    async def step(self, step: Callable[[], Awaitable[object]], doing: str) -> bool:
        """Run ``await step()``; on a Redis error log it and return False (the loop retries)."""
        try:
            await step()
        except (RedisConnectionLost, ReplyError) as exc:
            self.failed(doing, exc)
            return False
        return True

    def answering(self, within_s: float) -> tuple[bool, float]:
        """(Redis answered within ``within_s`` and since the last lost connection, age of that answer)."""
        age = time.monotonic() - self.last_ok
        return bool(self.last_ok) and self.last_ok >= self.last_error and age < within_s, age
