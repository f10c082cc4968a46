"""Cancellations: follow the cancel stream, remember cancelled tasks, stop the running ones."""

from __future__ import annotations

import logging
import time

import anyio

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import CancelMessage, decode
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.resp import Connection, RedisConnectionLost, ReplyError

__all__ = ["Cancels"]

log = logging.getLogger("asyncgraph.distributed.worker")

MEMORY_S = 3600.0  # how long a cancelled task id is remembered
_BLOCK_MS = 2000


class Cancels:
    """Which tasks were cancelled (``key in cancels``); a cancel stops the running ones.

    Admission reads ``key in cancels``; a task already running is stopped through
    ``ctx.slots``, which knows the running tasks and their runner.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self.config = ctx.config
        self.consumer = ctx.consumer
        self._cancelled: dict[tuple[str, str], float] = {}

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
            self._ctx.slots.stop(task_key, "cancelled")

    async def watch(self, redis_now_ms: float) -> None:
        """Follow the cancel stream from two leases before ``redis_now_ms`` (Redis's clock).

        It looks back a little: a cancel may predate this worker.
        """
        stream = keys.cancel_stream(self.config.queue)
        last_id: bytes | str = f"{max(0, int(redis_now_ms) - 2 * self.config.lease_ms)}-0"
        max_bulk = self.config.limits.max_message_bytes + keys.BULK_MARGIN
        conn: Connection | None = None
        try:
            while True:
                try:
                    if conn is None:
                        conn = await self._ctx.pool.connect()
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
                    self._ctx.health.failed("reading cancellations", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(0.5)
                    continue
                self._ctx.health.ok()
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
                self._ctx.signer,
                self.config.queue,
                self.config.limits,
            )
            if not isinstance(message, CancelMessage):
                raise WireError("not a cancel message")
        except WireError as exc:
            self._ctx.metrics.inc("asyncgraph_worker_dead_letters_total", reason="bad_cancel")
            log.warning("worker %s: ignored a cancel entry: %s", self.consumer, exc)
            return
        self.cancel(message.client, list(message.ids))
