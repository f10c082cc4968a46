"""Cancellations: follow the cancel stream, remember cancelled tasks, stop the running ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import CancelMessage, decode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._config import WorkerConfig
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._outcomes import Held
from asyncgraph.distributed.worker._redis_health import RedisHealth
from asyncgraph.resp import Connection, Pool, RedisConnectionLost, ReplyError

__all__ = ["Cancels"]

log = logging.getLogger("asyncgraph.distributed.worker")

MEMORY_S = 3600.0  # how long a cancelled task id is remembered
_BLOCK_MS = 2000


class Cancels:
    """Which tasks were cancelled (``key in cancels``), and the held ones to stop (``stop``)."""

    def __init__(
        self,
        config: WorkerConfig,
        consumer: str,
        pool: Pool,
        signer: Signer,
        health: RedisHealth,
        metrics: Metrics,
        redis_now_ms: Callable[[], float],
        stop: Callable[[Held, str], None],
    ) -> None:
        self.config = config
        self.stop = stop
        self.consumer = consumer
        self._pool = pool
        self._signer = signer
        self._health = health
        self._metrics = metrics
        self._redis_now_ms = redis_now_ms
        self._cancelled: dict[tuple[str, str], float] = {}
        self.running: dict[tuple[str, str], Held] = {}  # admitted, not yet settled

    def __contains__(self, key: object) -> bool:
        return key in self._cancelled

    def forget_old(self) -> None:
        now = time.monotonic()
        for task_key, until in list(self._cancelled.items()):
            if until < now:
                del self._cancelled[task_key]

    def cancel(self, client: str, task_ids: list[str]) -> None:
        until = time.monotonic() + MEMORY_S
        for task_id in task_ids:
            task_key = (client, task_id)
            self._cancelled[task_key] = until
            held = self.running.get(task_key)
            if held is not None:
                self.stop(held, "cancelled")

    async def watch(self) -> None:
        """Follow the cancel stream (looking back a little: a cancel may predate this worker)."""
        stream = keys.cancel_stream(self.config.queue)
        last_id: bytes | str = f"{max(0, int(self._redis_now_ms()) - 2 * self.config.lease_ms)}-0"
        max_bulk = self.config.limits.max_message_bytes + keys.BULK_MARGIN
        conn: Connection | None = None
        try:
            while True:
                try:
                    if conn is None:
                        conn = await self._pool.connect()
                    reply = await conn.execute(
                        "XREAD",
                        "COUNT",
                        512,
                        "BLOCK",
                        _BLOCK_MS,
                        "STREAMS",
                        stream,
                        last_id,
                        max_bulk=max_bulk,
                        max_items=512,
                        timeout_s=_BLOCK_MS / 1000 + self.config.redis_timeout_s,
                    )
                except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                    self._health.failed("reading cancellations", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(0.5)
                    continue
                self._health.ok()
                for entry_id, fields in reply[0][1] if reply else ():
                    last_id = entry_id
                    self._read(fields)
        finally:
            if conn is not None:
                await conn.aclose()

    def _read(self, fields: object) -> None:
        data = (
            dict(zip(fields[::2], fields[1::2], strict=False)) if isinstance(fields, list) else {}
        )
        try:
            message = decode(
                data.get(keys.F_MESSAGE),
                data.get(keys.F_SIGNATURE),
                self._signer,
                self.config.queue,
                self.config.limits,
            )
            if not isinstance(message, CancelMessage):
                raise WireError("not a cancel message")
        except WireError as exc:
            self._metrics.inc("asyncgraph_worker_dead_letters_total", reason="bad_cancel")
            log.warning("worker %s: ignored a cancel entry: %s", self.consumer, exc)
            return
        self.cancel(message.client, list(message.ids))
