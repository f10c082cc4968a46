"""Intake: new tasks (XREADGROUP) and tasks of silent holders (XAUTOCLAIM), read bounded.

Never more than ``concurrency`` tasks held at once, and fewer when recent entries
were big (a read buffers at most about ``READ_BUDGET`` bytes). While a reply is read,
a bulk string above ``max_message_bytes`` (plus a small margin) is skipped unread
(``Oversize``), and so is an entry with more fields than a task has (``Wide``): the
parser is linear, so such an entry costs its bytes once, and admission dead-letters it.
Before a batch is taken, the intake asks whether its clients are alive (at most one
round trip; NOTE [Client liveness] in ``distributed._liveness``); before the tasks it
admits run, it claims their replay memory (one round trip; NOTE [Replays] in
``worker._admission``).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from asyncgraph.distributed._liveness import ClientLiveness
from asyncgraph.distributed._yield import let_ready_tasks_run
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.worker._admission import MAX_FIELDS, Admitted, batch_clients
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.distributed.worker._membership import ensure_group, renewal
from asyncgraph.distributed.worker._outcomes import Held
from asyncgraph.distributed.worker._reply_writer import ReplyWriter
from asyncgraph.distributed.worker._tasks import Tasks
from asyncgraph.resp import Connection, Oversize, RedisConnectionLost, ReplyError

__all__ = ["Intake", "ReadSizer"]

log = logging.getLogger("asyncgraph.distributed.worker")

BLOCK_MS = 2000
# Bytes one read of the task stream should buffer at most: after a read with big
# entries, the next reads ask for fewer (at least one).
READ_BUDGET = 64 * 1024 * 1024
ASSUMED_ENTRY = 1024  # entry size assumed before any was read


class ReadSizer:
    """How many entries to ask for: free slots, the batch size, and the read budget."""

    def __init__(self, batch_size: int, max_bulk: int) -> None:
        self.batch_size = batch_size
        self.max_bulk = max_bulk
        self.entry_bytes = ASSUMED_ENTRY

    def count(self, free: int) -> int:
        return max(1, min(free, self.batch_size, READ_BUDGET // self.entry_bytes))

    def max_items(self, count: int) -> int:
        """Arrays longer than this are skipped unread: an entry's fields, a reply's entries."""
        return max(count, 2 * MAX_FIELDS)

    def note(self, entries: list[Any]) -> None:
        """Remember how big the entries just read were (for the next read's count)."""
        largest = 0
        for entry in entries:
            if entry is None or type(entry[1]) is not list:
                continue
            for value in entry[1]:
                if type(value) is bytes:
                    size = len(value)
                elif isinstance(value, Oversize):
                    size = value.size
                else:
                    continue
                if size > largest:
                    largest = size
        self.entry_bytes = max(ASSUMED_ENTRY, min(largest, self.max_bulk))


class Intake:
    """The reader and the reclaimer of one worker: each task read goes to ``tasks.admit``,
    and the admitted ones of a batch to ``tasks.start`` once their memory is claimed.

    They read as many tasks as ``ctx.slots`` has free slots (the reader waits for one).
    """

    def __init__(self, ctx: WorkerContext, writer: ReplyWriter, tasks: Tasks) -> None:
        self.config = ctx.config
        self.consumer = ctx.consumer
        self._pool = ctx.pool
        self._health = ctx.health
        self._metrics = ctx.metrics
        self._slots = ctx.slots
        self._writer = writer
        self._tasks = tasks
        self._stream = keys.task_stream(ctx.config.queue)
        self.clients = ClientLiveness()
        self.sizer = ReadSizer(
            ctx.config.batch_size, ctx.config.limits.max_message_bytes + keys.BULK_MARGIN
        )

    async def _ensure_group(self) -> None:
        await ensure_group(self._pool, self.config.queue)

    async def reader(self) -> None:
        conn: Connection | None = None
        backoff = 0.05
        try:
            while True:
                count = self.sizer.count(await self._slots.wait_free())
                try:
                    if conn is None:
                        conn = await self._pool.connect()
                    reply = await self._read(conn, count)
                    backoff = 0.05
                except (RedisConnectionLost, TimeoutError, ReplyError) as exc:
                    if isinstance(exc, ReplyError) and exc.code == "NOGROUP":
                        # The stream was deleted, or Redis restarted empty: start over.
                        if await self._health.step(self._ensure_group, "creating the group"):
                            continue
                    else:
                        # Reading on after a lost reply is safe: what that XREADGROUP
                        # delivered stays pending to this consumer, unheld and unrenewed,
                        # and the reclaimers take it back once its lease has passed.
                        self._health.failed("reading tasks", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                self._health.ok()
                if reply:
                    await self._start(reply[0][1])
        finally:
            if self._writer.pending:
                self._writer.wake()  # never strand settled tasks when intake stops
            if conn is not None:
                await conn.aclose()

    async def _read(self, conn: Connection, count: int) -> Any:
        return await conn.execute(
            "XREADGROUP",
            "GROUP",
            keys.GROUP,
            self.consumer,
            "COUNT",
            count,
            "BLOCK",
            BLOCK_MS,
            "STREAMS",
            self._stream,
            ">",
            max_bulk=self.sizer.max_bulk,
            max_items=self.sizer.max_items(count),
            timeout_s=BLOCK_MS / 1000 + self.config.redis_timeout_s,
        )

    async def _ask_clients(self, entries: list[Any]) -> None:
        """Learn which clients of a batch died: one round trip at most (NOTE [Client liveness])."""
        now = anyio.current_time()
        asked = self.clients.to_ask(batch_clients(entries), now)
        if not asked:
            return
        queue = self.config.queue
        try:
            exists = await self._pool.pipeline(
                [["EXISTS", keys.client_key(queue, client)] for client in asked]
            )
        except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
            # Not known: the tasks run (a reply too many costs less than a task lost).
            log.debug("worker %s: asking for clients' heartbeats: %s", self.consumer, exc)
            return
        self.clients.learn(asked, exists, now)

    async def _start_first_runs(self, admitted: list[tuple[Held, Admitted]]) -> None:
        """Claim the admitted tasks in the replay memory (one round trip; a second only for
        those another claim holds) and start those that are theirs to run (NOTE [Replays]
        in ``worker._admission``)."""
        if not admitted:
            return
        try:
            # Sent again after a lost connection: a claim written twice finds itself (held
            # by this entry, read back: it runs), and the rest are reads or expiries.
            replies = await self._pool.pipeline(self._tasks.claims(admitted), retry=True)
        except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
            self._hand_back(admitted, exc)
            return
        held = [
            task
            for i, task in enumerate(admitted)
            if self._tasks.start(*task, replies[2 * i], replies[2 * i + 1])
        ]
        if not held:
            return
        try:
            stored = await self._pool.pipeline(
                [["HGET", task.memory.claims, task.memory.field] for _, task in held]
            )
        except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
            self._hand_back(held, exc)
            return
        for (entry, task), value in zip(held, stored, strict=True):
            self._tasks.start_held(entry, task, value)

    def _hand_back(self, admitted: list[tuple[Held, Admitted]], exc: Exception) -> None:
        # Not known whether their claims were written: they do not run now, nor are they
        # refused; their reclaim, after the lease, claims them again.
        log.warning(
            "worker %s: claiming %d task(s) in the replay memory: %s; they are left to be "
            "reclaimed",
            self.consumer,
            len(admitted),
            exc,
        )
        self._tasks.hand_back(admitted)

    async def _start(self, entries: list[Any]) -> None:
        self.sizer.note(entries)
        await self._ask_clients(entries)
        gone = self.clients.gone
        self._writer.batching = True
        try:
            admitted = [
                self._tasks.admit(entry_id, fields, 1, gone) for entry_id, fields in entries
            ]
            await self._start_first_runs([a for a in admitted if a is not None])
            # Let the tasks just started take their first step. Those that finish at once
            # queue their replies for this reader, which sends them before its next
            # blocking read: writing to Redis first would wake the server, which can take
            # this CPU while the replies wait.
            await let_ready_tasks_run()
        finally:
            self._writer.batching = False
        if self._writer.pending:
            if self._writer.flushing or not await self._writer.flush():
                self._writer.wake()  # the writer's loop sends it (and retries with backoff)

    async def reclaimer(self) -> None:
        """Take over tasks whose holder stopped renewing its lease (dead or stuck)."""
        cursor: bytes | str = "0-0"
        tick_s = max(50, self.config.lease_ms // 4) / 1000
        while True:
            await anyio.sleep(tick_s)
            free = self._slots.free
            if free <= 0:
                continue
            try:
                cursor, entries = await self._reclaim(cursor, self.sizer.count(free))
            except (RedisConnectionLost, ReplyError) as exc:
                if isinstance(exc, ReplyError) and exc.code == "NOGROUP":
                    await self._health.step(self._ensure_group, "creating the group")
                else:
                    self._health.failed("reclaiming tasks", exc)
                    # A claim whose reply came too late is ours in Redis all the same:
                    # hand such entries back at once rather than leave them unrenewed.
                    await self._health.step(self._hand_back_strays, "handing back claims")
                continue
            await self._ask_clients(entries)
            admitted = []
            for entry_id, fields, deliveries in entries:
                self._metrics.inc("asyncgraph_worker_reclaimed_total")
                log.info(
                    "worker %s reclaimed task entry %s (delivery %d)",
                    self.consumer,
                    entry_id.decode(),
                    deliveries,
                )
                admitted.append(self._tasks.admit(entry_id, fields, deliveries, self.clients.gone))
            await self._start_first_runs([a for a in admitted if a is not None])

    async def _reclaim(
        self, cursor: bytes | str, count: int
    ) -> tuple[bytes | str, list[tuple[bytes, Any, int]]]:
        """One XAUTOCLAIM: the next cursor, and the claimed entries with their delivery counts.

        The leases of the tasks this worker holds are renewed in the same round trip, just
        before: after a stall past the lease (a busy machine, a blocked event loop) the
        claim would otherwise take this worker's own tasks too, and each such claim counts
        a delivery, so a task that never changed hands would reach ``max_attempts`` and be
        dead-lettered when the next worker reclaims it."""
        held = list(self._slots.held)
        autoclaim: list[bytes | str | int] = ["XAUTOCLAIM", self._stream, keys.GROUP]
        autoclaim += [self.consumer, self.config.lease_ms, cursor, "COUNT", count]
        *_, reply = await self._pool.pipeline(
            [*([renewal(self.config.queue, self.consumer, held)] if held else []), autoclaim],
            max_bulk=self.sizer.max_bulk,
            max_items=self.sizer.max_items(count),
        )
        if isinstance(reply, ReplyError):
            raise reply
        scanned_from, cursor = cursor, reply[0]
        self.sizer.note(reply[1])
        entries = [(e[0], e[1]) for e in reply[1] if e is not None]
        # Entries deleted from the stream while pending (a cancelled task whose holder
        # died): Redis >= 7 lists their ids apart, Redis 6.2 returns nil.
        gone = [e[0] for e in reply[1] if e is not None and e[1] is None]
        if len(reply) > 2 and reply[2]:
            gone += list(reply[2])
        elif any(e is None for e in reply[1]):
            gone += await self._claimed_but_deleted(scanned_from, entries)
        entries = [(i, f) for i, f in entries if f is not None and i not in self._slots.held]
        if gone:
            await self._pool.execute("XACK", self._stream, keys.GROUP, *gone)
        if not entries:
            return cursor, []
        counts = await self._pool.pipeline(
            [["XPENDING", self._stream, keys.GROUP, i, i, 1] for i, _ in entries]
        )
        return cursor, [
            (i, f, int(p[0][3]) if isinstance(p, list) and p else 2)
            for (i, f), p in zip(entries, counts, strict=True)
        ]

    async def _claimed_but_deleted(
        self, scanned_from: bytes | str, entries: list[tuple[bytes, Any]]
    ) -> list[bytes]:
        """Ids of deleted entries the last XAUTOCLAIM gave this consumer (Redis 6.2).

        They are ours now, were delivered before (count >= 2: never a fresh read in
        flight), lie in the scanned range and are neither held nor returned with data.
        """
        claimed = {i for i, _ in entries}
        rows = await self._pool.execute(
            "XPENDING",
            self._stream,
            keys.GROUP,
            scanned_from,
            "+",
            self.config.batch_size,
            self.consumer,
        )
        return [
            row[0]
            for row in rows
            if int(row[3]) >= 2
            and row[0] not in claimed
            and row[0] not in self._slots.held
            and int(row[2]) < self.config.lease_ms
        ]

    async def _hand_back_strays(self) -> None:
        """Make this consumer's pending entries that it does not hold reclaimable at once.

        Only reclaimed ones (delivery count >= 2): a fresh XREADGROUP delivery may be in
        flight to the reader. Handed back with an idle time past the lease, they are the
        next XAUTOCLAIM's, this worker's or another's.
        """
        rows = await self._pool.execute(
            "XPENDING", self._stream, keys.GROUP, "-", "+", self.config.batch_size, self.consumer
        )
        strays = [row[0] for row in rows if int(row[3]) >= 2 and row[0] not in self._slots.held]
        if strays:
            await self._pool.execute(
                "XCLAIM",
                self._stream,
                keys.GROUP,
                self.consumer,
                0,
                *strays,
                "IDLE",
                self.config.lease_ms * 10,
                "JUSTID",
            )
            log.info("worker %s handed back %d late claim(s)", self.consumer, len(strays))
