"""Writing what settles tasks: replies, dead letters and acknowledgements, in one MULTI.

A task is acknowledged (XACK + XDEL) in the same transaction that writes its reply,
so a worker that dies before writing leaves it pending (another worker re-runs it).
Nothing settled is ever dropped: a write that fails is retried with backoff, and a
transaction that Redis refuses (``EXECABORT``: e.g. ``OOM`` at ``maxmemory`` with
``noeviction``) is retried task by task, so one refused reply never holds the others;
a task whose reply keeps being refused gets, in its place, a short error reply that
tells its client what Redis said.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import ErrorInfo
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.distributed.worker._outcomes import Replies, Settled
from asyncgraph.resp import RedisConnectionLost, ReplyError

__all__ = ["ReplyWriter"]

log = logging.getLogger("asyncgraph.distributed.worker")

REFUSALS_BEFORE_ERROR_REPLY = 3  # a refused reply is retried this often, then replaced


class ReplyWriter:
    """Queues ``Settled`` tasks and writes them; their slots are released once written."""

    def __init__(self, ctx: WorkerContext, replies: Replies) -> None:
        self._slots = ctx.slots
        self._pool = ctx.pool
        self._tasks = keys.task_stream(ctx.config.queue)
        self.replies = replies
        self._health = ctx.health
        self._metrics = ctx.metrics
        self._outgoing: list[Settled] = []
        self._ready: anyio.Event | None = None
        self.flushing = 0
        self.batching = False  # the reader is starting a batch: it flushes it itself

    @property
    def pending(self) -> bool:
        return bool(self._outgoing)

    def queue(self, settled: Settled) -> None:
        """Write ``settled`` soon (with the batch the reader is taking, if any)."""
        self._metrics.inc("asyncgraph_worker_tasks_total", outcome=settled.outcome)
        self._outgoing.append(settled)
        if not self.batching:
            self.wake()

    def wake(self) -> None:
        if self._ready is not None:
            self._ready.set()

    async def run(self) -> None:
        """Write what was queued, whenever something is; retry with backoff while Redis fails."""
        self._ready = anyio.Event()
        if self._outgoing:
            self._ready.set()
        backoff = 0.05
        while True:
            await self._ready.wait()
            self._ready = anyio.Event()
            if await self.flush():
                backoff = 0.05
            else:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._ready.set()

    async def flush(self) -> bool:
        """One MULTI: replies, dead letters, EXPIREs, XACK + XDEL. False if any is left to retry."""
        batch, self._outgoing = self._outgoing, []
        if not batch:
            return True
        self.flushing += 1
        try:
            try:
                # Shielded (bounded by the pool's deadline): cut in the middle, the
                # replies would be written without their acknowledgements. Sent again
                # after a lost connection (see _transaction).
                replies = await self._pool.pipeline(
                    self._transaction(batch), shield=True, retry=True
                )
            except RedisConnectionLost as exc:
                self._health.failed(f"writing {len(batch)} repl(ies) (will retry)", exc)
                self._outgoing[:0] = batch
                return False
            self._health.ok()
            if not isinstance(replies[-1], ReplyError):
                self._slots.release([s.held.entry_id for s in batch])
                return True
            # Refused (EXECABORT): nothing of it was written. Task by task, so that only
            # the ones Redis refuses wait, and what Redis said reaches their clients.
            return await self._one_by_one(batch, _cause(replies))
        finally:
            self.flushing -= 1

    async def _one_by_one(self, batch: list[Settled], cause: ReplyError) -> bool:
        log.warning(
            "worker %s: Redis refused the reply transaction of %d task(s): %s; retrying each",
            self.replies.consumer,
            len(batch),
            cause,
        )
        left: list[Settled] = []
        for index, settled in enumerate(batch):
            try:
                replies = await self._pool.pipeline(
                    self._transaction([settled]), shield=True, retry=True
                )
            except RedisConnectionLost as exc:
                self._health.failed("writing replies (will retry)", exc)
                left += batch[index:]
                break
            if not isinstance(replies[-1], ReplyError):
                self._slots.release([settled.held.entry_id])
                continue
            left.append(await self._refused(settled, _cause(replies)))
        self._outgoing[:0] = left
        return not left

    async def _refused(self, settled: Settled, cause: ReplyError) -> Settled:
        """``settled`` to retry; after a few refusals, with a short error reply in place of its own.

        Before the short reply, the task entry is acknowledged and deleted on its own
        (XACK and XDEL are allowed at maxmemory, and free the task's payload): the result
        is lost anyway, and re-running the task would only meet the same refusal.
        """
        settled.refusals += 1
        self._metrics.inc("asyncgraph_worker_redis_refusals_total", code=cause.code)
        if settled.refusals < REFUSALS_BEFORE_ERROR_REPLY or settled.client is None:
            return settled
        entry = settled.held.entry_id
        try:
            await self._pool.pipeline(
                [["XACK", self._tasks, keys.GROUP, entry], ["XDEL", self._tasks, entry]]
            )
        except RedisConnectionLost as exc:
            self._health.failed("acknowledging a refused task (will retry)", exc)
            return settled
        assert settled.task_id is not None
        text = (
            f"Redis refused to store the reply of task {settled.task_id} "
            f"({settled.refusals} attempts): {cause}. The result is lost; the task was not "
            f"re-run. If this is OOM, Redis is at maxmemory: raise maxmemory, or make sure "
            f"clients read their replies; the queue needs maxmemory-policy noeviction"
        )
        log.warning("worker %s: %s", self.replies.consumer, text)
        # The dead letters of the original, then the short reply (no big payload).
        dead = [c for c in settled.commands if c[0] == "XADD" and c[1] == self.replies.dead_stream]
        info = ErrorInfo("redis_refused", "ReplyError", text)
        short = self.replies.error(
            settled.held, settled.client, settled.task_id, info, settled.outcome, *dead
        )
        short.refusals = settled.refusals
        short.memory, short.answered = settled.memory, settled.answered
        short.reply_ttl_s = settled.reply_ttl_s
        return short

    def _transaction(self, batch: list[Settled]) -> list[list[Any]]:
        """The MULTI that settles ``batch``: safe to send twice (``retry=True``).

        Run twice, it writes each reply (and dead letter) twice; a client joins a task
        once and drops the second reply, and acknowledging and deleting are idempotent.
        This writer sends a batch again after a failure anyway.
        """
        ids = [s.held.entry_id for s in batch]
        commands: list[list[Any]] = [["MULTI"]]
        answered: dict[str, int] = {}  # bitmap -> its expiry
        reply_ttl: dict[str, int] = {}  # reply stream -> seconds to keep it
        for settled in batch:
            commands.extend(settled.commands)
            memory = settled.memory
            if memory is not None:  # NOTE [Replays] in worker._admission
                if settled.answered:
                    commands.append(["SETBIT", memory.answered, memory.bit, 1])
                    answered[memory.answered] = memory.expire_at_ms
                commands.append(["HDEL", memory.claims, memory.field])
            if settled.reply_stream:
                ttl = reply_ttl.get(settled.reply_stream, 0)
                reply_ttl[settled.reply_stream] = max(ttl, settled.reply_ttl_s)
        commands += [["PEXPIREAT", key, at] for key, at in answered.items()]
        # A reply stream is kept as long as its client may wait for a reply in it, and no
        # longer (a dead client's replies expire unread): one EXPIRE per stream per batch.
        commands += [["EXPIRE", stream, ttl] for stream, ttl in reply_ttl.items()]
        commands += [
            ["XACK", self._tasks, keys.GROUP, *ids],
            ["XDEL", self._tasks, *ids],
            ["EXEC"],
        ]
        return commands


def _cause(replies: list[Any]) -> ReplyError:
    """The first error among a refused transaction's replies (the reason of its EXECABORT)."""
    for reply in replies[1:-1]:
        if isinstance(reply, ReplyError):
            return reply
    last = replies[-1]
    return last if isinstance(last, ReplyError) else ReplyError("ERR unknown")
