"""Cancellations: follow the cancel stream, remember cancelled tasks, stop the running ones.

Bounded, since on an unsigned fleet anyone who can write to the stream can send
cancels: a message naming more than ``MAX_IDS_PER_CANCEL`` tasks is refused before it
is decoded into objects (msgpack checks the array's length first), and at most
``MAX_CANCELLED`` ids are remembered, the oldest forgotten first. A cancel that is
refused or forgotten costs only work: its client already deleted the queued tasks and
no longer waits for the replies; a running task then ends at its deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import anyio

from asyncgraph import WireError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import CancelMessage, decode
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.resp import Connection, RedisConnectionLost, ReplyError

__all__ = ["Cancels"]

log = logging.getLogger("asyncgraph.distributed.worker")

MEMORY_S = 3600.0  # how long a cancelled task id is remembered
MAX_IDS_PER_CANCEL = 50_000  # task ids in one cancel message, at most
MAX_CANCELLED = 100_000  # task ids remembered, at most
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
        # (client, task id) -> until when it is remembered (monotonic), oldest first.
        self._cancelled: OrderedDict[tuple[str, str], float] = OrderedDict()
        # A cancel message is decoded with this bound on its arrays (the ids).
        self._limits = dataclasses.replace(
            ctx.config.limits,
            max_container_len=min(ctx.config.limits.max_container_len, MAX_IDS_PER_CANCEL),
        )

    def __contains__(self, key: object) -> bool:
        return key in self._cancelled

    def __len__(self) -> int:
        """How many cancelled task ids are remembered (at most ``MAX_CANCELLED``)."""
        return len(self._cancelled)

    def forget_old(self) -> None:
        now = time.monotonic()
        while self._cancelled and next(iter(self._cancelled.values())) < now:
            self._cancelled.popitem(last=False)

    def cancel(self, client: str, task_ids: list[str]) -> None:
        until = time.monotonic() + MEMORY_S
        for task_id in task_ids:
            task_key = (client, task_id)
            self._cancelled[task_key] = until
            self._cancelled.move_to_end(task_key)
            self._ctx.slots.stop(task_key, "cancelled")
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.popitem(last=False)

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
                self._limits,
            )
            if not isinstance(message, CancelMessage):
                raise WireError("not a cancel message")
        except WireError as exc:
            self._ctx.metrics.inc("asyncgraph_worker_dead_letters_total", reason="bad_cancel")
            log.warning(
                "worker %s: ignored a cancel entry (at most %d task ids per cancel): %s",
                self.consumer,
                MAX_IDS_PER_CANCEL,
                exc,
            )
            return
        self.cancel(message.client, list(message.ids))
