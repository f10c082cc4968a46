"""A worker's standing in its queue: the group, the clock, leases, heartbeat, consumers.

- the worker connects with backoff until Redis answers (at most ``connect_timeout_s``
  when set), creating the consumer group and reading Redis's clock;
- it renews the lease of what it holds every ``lease_ms / 3`` (XCLAIM ... JUSTID, which
  does not count as a delivery);
- it writes its heartbeat (an expiry in the workers hash, and what ``asyncgraph
  status`` shows in the info hash) every ``min(lease_ms / 3, 5 s)``;
- housekeeping: it forgets stale heartbeats, and deletes consumers that hold no
  pending entry, have no live heartbeat and received nothing for ``2 x lease_ms``
  (workers that died, however young; see NOTE [Consumer sweep]);
- on the way out it drops its heartbeat, and after a full drain its consumer too;
  tasks left unfinished by a drain that timed out are handed back at once.

NOTE [Consumer sweep]: a worker killed hard (SIGKILL, OOM) leaves its consumer in the
group. Every worker sweeps such consumers at start, again ``2 x lease_ms`` (plus a
heartbeat) later, when those too young for the first sweep can go, then every
``housekeeping_every_s()``. The sweep at start is what keeps a crash loop from piling
up consumers: a worker restarted every few seconds never lives a full period, and
each restart would otherwise leave one more consumer behind.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator

import anyio

import asyncgraph
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.resp import Pool, RedisConnectionLost, ReplyError

__all__ = ["Membership", "ensure_group", "renewal"]

log = logging.getLogger("asyncgraph.distributed.worker")

CONSUMER_IDLE_LEASES = 2  # a consumer idle this long, holding nothing, without heartbeat, goes
STALE_BEAT_MS = 60_000


def renewal(queue: str, consumer: str, entry_ids: list[bytes]) -> list[bytes | str | int]:
    """The command that renews ``consumer``'s lease of ``entry_ids`` in ``queue``: XCLAIM
    with a minimum idle time of 0 and ``JUSTID``, which resets their idle time without
    counting a delivery."""
    return ["XCLAIM", keys.task_stream(queue), keys.GROUP, consumer, 0, *entry_ids, "JUSTID"]


async def ensure_group(pool: Pool, queue: str) -> None:
    """Create ``queue``'s consumer group (and its task stream) unless it exists."""
    try:
        # Sent again after a lost connection: a repeat answers BUSYGROUP, read as done.
        await pool.execute(
            "XGROUP", "CREATE", keys.task_stream(queue), keys.GROUP, "0", "MKSTREAM", retry=True
        )
    except ReplyError as exc:
        if exc.code != "BUSYGROUP":
            raise


class Membership:
    """The worker ``ctx`` describes, in its queue: what ``Worker`` runs to join, stay and leave."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self.config = ctx.config
        self.consumer = ctx.consumer
        self._pool = ctx.pool
        self._health = ctx.health
        self._metrics = ctx.metrics
        self._tasks = keys.task_stream(ctx.config.queue)
        self._workers = keys.workers_hash(ctx.config.queue)
        self._infos = keys.workers_info_hash(ctx.config.queue)
        self.clock_offset_ms = 0.0
        self.connected = False
        self.beat_s = min(ctx.config.lease_ms / 3000, 5.0)
        self._started_at = time.time()
        self._rate_mark = (time.monotonic(), 0)  # (when, settled then): the last beat's

    # -- joining -------------------------------------------------------------------------
    async def connect(self) -> None:
        """Set up the group and the clock, retrying with backoff until Redis answers."""
        timeout_s = self.config.connect_timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s else None
        backoff = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.ensure_group()
                await self.sync_clock()
            except (RedisConnectionLost, ReplyError) as exc:
                self._metrics.inc("asyncgraph_worker_redis_errors_total")
                self._health.last_error = time.monotonic()
                if deadline is not None and time.monotonic() + backoff > deadline:
                    raise RedisConnectionLost(
                        f"worker {self.consumer}: Redis at {self._pool.address.display} did not "
                        f"answer within connect_timeout_s={timeout_s:g} ({attempt} attempt(s); "
                        f"last error: {exc})"
                    ) from exc
                log.warning(
                    "worker %s: cannot reach Redis (attempt %d): %s; retrying in %.1fs",
                    self.consumer,
                    attempt,
                    exc,
                    backoff,
                )
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.connected = True
            if attempt > 1:
                log.info(
                    "worker %s: connected to Redis at %s", self.consumer, self._pool.address.display
                )
            return

    async def ensure_group(self) -> None:
        await ensure_group(self._pool, self.config.queue)

    async def sync_clock(self) -> None:
        before = time.time()
        seconds, micros = await self._pool.execute("TIME")
        after = time.time()
        redis_ms = int(seconds) * 1000 + int(micros) / 1000
        self.clock_offset_ms = redis_ms - (before + after) * 500
        self._health.ok()

    def redis_now_ms(self) -> float:
        return time.time() * 1000 + self.clock_offset_ms

    def queued_s(self, entry_id: bytes) -> float:
        """Seconds from the entry's XADD (its id is Redis time) until now (Redis's clock)."""
        try:
            return max(0.0, (self.redis_now_ms() - int(entry_id.split(b"-", 1)[0])) / 1000)
        except ValueError:
            return 0.0

    # -- staying -------------------------------------------------------------------------
    async def lease_renewer(self) -> None:
        period = self.config.lease_ms / 3000
        while True:
            await anyio.sleep(period)
            ids = list(self._ctx.slots.held)
            if not ids:
                continue
            try:
                await self._pool.execute(*renewal(self.config.queue, self.consumer, ids))
            except (RedisConnectionLost, ReplyError) as exc:
                self._health.failed("renewing leases", exc)
            else:
                self._health.ok()

    async def beat(self) -> None:
        """One heartbeat: the expiry, and what ``asyncgraph status`` shows."""
        await self.sync_clock()
        expiry = int(self.redis_now_ms() + 3 * self.beat_s * 1000 + 1000)
        await self._pool.pipeline(
            [
                ["HSET", self._workers, self.consumer, expiry],
                ["HSET", self._infos, self.consumer, self.info_json()],
            ]
        )
        self._health.ok()

    def info_json(self) -> str:
        """What ``asyncgraph status`` shows of this worker (plain JSON, never code)."""
        slots = self._ctx.slots
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": self.config.concurrency,
                "in_flight": len(slots.held),
                "abandoned": slots.abandoned,
                "settled": slots.settled,
                "settled_per_s": self._settled_rate(),
                "version": asyncgraph.__version__,
                "draining": self._ctx.stopping.draining,
                "started": self._started_at,
            }
        )

    def _settled_rate(self) -> float:
        """Tasks settled per second since the previous status this worker published."""
        now, settled = time.monotonic(), self._ctx.slots.settled
        then, before = self._rate_mark
        self._rate_mark = (now, settled)
        return round((settled - before) / (now - then), 2) if now > then else 0.0

    def housekeeping_every_s(self) -> float:
        return min(30.0, 3 * CONSUMER_IDLE_LEASES * self.config.lease_ms / 1000)

    def housekeeping_periods(self) -> Iterator[float]:
        """Seconds between sweeps, the first one at start (see NOTE [Consumer sweep])."""
        every_s = self.housekeeping_every_s()
        yield min(every_s, CONSUMER_IDLE_LEASES * self.config.lease_ms / 1000 + self.beat_s)
        while True:
            yield every_s

    async def housekeeping(self) -> None:
        """Forget stale heartbeats; delete consumers idle, holding nothing, not alive."""
        now_ms = self.redis_now_ms()
        beats = await self._pool.execute("HGETALL", self._workers)
        alive = {beats[i] for i in range(0, len(beats), 2) if int(beats[i + 1]) >= now_ms}
        stale = [
            beats[i] for i in range(0, len(beats), 2) if int(beats[i + 1]) < now_ms - STALE_BEAT_MS
        ]
        if stale:
            await self._pool.pipeline(
                [["HDEL", self._workers, *stale], ["HDEL", self._infos, *stale]]
            )
        idle_limit_ms = CONSUMER_IDLE_LEASES * self.config.lease_ms
        for info in await self._pool.execute("XINFO", "CONSUMERS", self._tasks, keys.GROUP):
            fields = dict(zip(info[::2], info[1::2], strict=False))
            name = fields.get(b"name")
            if (
                not isinstance(name, bytes)
                or name in alive
                or name == self.consumer.encode()
                or fields.get(b"pending") != 0
                or int(fields.get(b"idle", 0)) < idle_limit_ms
            ):
                continue
            if await self.delete_consumer(name):
                log.info(
                    "worker %s: deleted consumer %s (idle %d ms, nothing pending, no heartbeat)",
                    self.consumer,
                    name.decode(errors="replace"),
                    int(fields[b"idle"]),
                )

    async def delete_consumer(self, name: str | bytes) -> bool:
        """XGROUP DELCONSUMER ``name`` if it holds no pending entry; True if deleted.

        DELCONSUMER drops the consumer's pending entries with it (they could never be
        reclaimed), hence the check first. The two are not atomic (WATCH does not see
        deliveries): that is safe for this worker's own consumer once its reader has
        stopped, and for another one only because the sweep picks consumers without a
        live heartbeat that have received nothing for two leases (a dead worker's). In
        the unlikely case that such a worker is alive after all and gets a task in
        between, it still runs and answers it; only a crash of that worker before it
        answers would leave the task unreclaimed (its caller times out).
        """
        held = await self._pool.execute("XPENDING", self._tasks, keys.GROUP, "-", "+", 1, name)
        if held:
            return False
        await self._pool.execute("XGROUP", "DELCONSUMER", self._tasks, keys.GROUP, name)
        return True

    def supervisor_gone(self) -> bool:
        pid = self.config.supervisor_pid
        return bool(pid) and os.getppid() != pid

    # -- leaving -------------------------------------------------------------------------
    async def leave(self, drained: bool) -> None:
        """On the way out: drop the heartbeat; after a full drain, the consumer too (bounded)."""
        with anyio.move_on_after(self.config.redis_timeout_s):
            try:
                await self._pool.pipeline(
                    [["HDEL", self._workers, self.consumer], ["HDEL", self._infos, self.consumer]]
                )
                if drained and await self.delete_consumer(self.consumer):
                    log.info("worker %s: left the consumer group (nothing pending)", self.consumer)
            except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                log.warning("worker %s: leaving the group: %s", self.consumer, exc)

    async def hand_back(self, entry_ids: list[bytes]) -> None:
        """Make ``entry_ids`` reclaimable by other workers at once (after a drain that timed out)."""
        if not entry_ids:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.redis_timeout_s):
            try:
                await self._pool.execute(
                    "XCLAIM",
                    self._tasks,
                    keys.GROUP,
                    self.consumer,
                    0,
                    *entry_ids,
                    "IDLE",
                    self.config.lease_ms * 10,
                    "JUSTID",
                )
                log.info("worker %s released %d unfinished task(s)", self.consumer, len(entry_ids))
            except (RedisConnectionLost, ReplyError) as exc:
                log.warning("worker %s: releasing unfinished tasks: %s", self.consumer, exc)
