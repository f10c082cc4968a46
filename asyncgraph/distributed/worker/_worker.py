"""The worker loop: serve remote backwards (and forwards) from one Redis queue.

Delivery is at-least-once with idempotent completion:

- the worker connects to Redis with backoff until it answers (at most
  ``connect_timeout_s`` when set), serving its health endpoint meanwhile;
- tasks are read in batches with XREADGROUP, never more than ``concurrency``
  held at once, and fewer when recent entries were big (a read buffers at most
  about ``_READ_BUDGET`` bytes); a bulk string above ``max_message_bytes`` (plus a
  small margin) is skipped unread and its entry dead-lettered as "oversize";
- every task runs in its own task: async backwards and forwards on the event
  loop, synchronous ones in a worker thread (at most ``concurrency`` threads), so
  a slow synchronous function never stalls leases, heartbeats or cancellations;
- a task is acknowledged (XACK + XDEL) in the same MULTI that writes its reply,
  so a worker that dies before replying leaves it pending;
- the worker renews the lease of what it holds every ``lease_ms / 3``
  (XCLAIM ... JUSTID, which does not count as a delivery);
- every ``lease_ms / 4`` (at most 2.5 s) it reclaims tasks whose holder has
  been silent for ``lease_ms`` (XAUTOCLAIM), even when no new work arrives;
- a task delivered more than ``max_attempts`` times is dead-lettered, and its
  client gets an error saying so; one whose backward raised is answered with
  the error and the worker's traceback, and a copy goes to the dead-letter stream;
- a task whose deadline passed, or that its client cancelled, is skipped, or
  stopped if it is running;
- anything in the task stream that does not decode, verify and validate is
  dead-lettered with the reason, and the loop goes on; when its signature checked
  out (or no secret is set) and its client and task ids can be read, the client
  also gets an error reply, so it fails at once instead of at its timeout;
- a worker that stops after draining deletes its consumer from the group when it
  holds no pending entry, and workers delete consumers that have received nothing
  for ``10 x lease_ms``, hold nothing and have no live heartbeat.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import signal
import socket
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

import asyncgraph
from asyncgraph import FunctionCtx, WireError, no_grad
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._payload import (
    ctx_from_state,
    ctx_state,
    forward_args,
    grads_from_entries,
    result_entries,
)
from asyncgraph.distributed.wire._schema import (
    CancelMessage,
    ErrorInfo,
    ReplyMessage,
    TaskMessage,
    decode,
    encode,
    peek_ids,
)
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._config import WorkerConfig
from asyncgraph.distributed.worker._health import serve_health
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._registry import RegisteredFunction, Registry
from asyncgraph.executors import let_ready_tasks_run
from asyncgraph.models import Usage, restrict_base_urls, track_usage
from asyncgraph.resp import (
    Connection,
    Oversize,
    Pool,
    RedisConnectionLost,
    ReplyError,
    parse_redis_url,
)

__all__ = ["Worker", "WorkerConfig"]

log = logging.getLogger("asyncgraph.distributed.worker")

_BLOCK_MS = 2000
_MAX_ORIGINAL = 65_536
_MAX_TRACEBACK = 32_768
_CANCEL_MEMORY_S = 3600.0
# Bytes one read of the task stream should buffer at most: after a read with big
# entries, the next reads ask for fewer (at least one).
_READ_BUDGET = 64 * 1024 * 1024
_ASSUMED_ENTRY = 1024  # entry size assumed before any was read
_CONSUMER_IDLE_LEASES = 10  # a consumer idle this many leases, holding nothing, is removed
_STALE_BEAT_MS = 60_000


@dataclass(eq=False)
class _Held:
    """A task this worker holds: read, not yet acknowledged."""

    entry_id: bytes
    key: tuple[str, str] | None = None
    scope: anyio.CancelScope | None = None
    deadline: float = 0.0


@dataclass(eq=False)
class _Outcome:
    held: _Held
    commands: list[list[Any]] = field(default_factory=list)
    reply_stream: str | None = None


def _hinted_ids(data: dict[Any, Any]) -> tuple[str, str] | None:
    """(client, task id) from an entry's unsigned hints, when both are well formed."""
    client, task_id = data.get(keys.F_CLIENT_HINT), data.get(keys.F_TASK_HINT)
    if not (isinstance(client, bytes) and isinstance(task_id, bytes) and 0 < len(task_id) <= 64):
        return None
    client_id = client.decode(errors="replace")
    return (client_id, task_id.decode(errors="replace")) if keys.is_client_id(client_id) else None


class Worker:
    """Serves ``registry`` on ``config.queue`` until cancelled or drained (SIGTERM).

    ``await Worker(config, registry).serve()``; ``drain()`` stops taking tasks
    and lets the ones held finish (at most ``drain_timeout_s``).
    """

    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.consumer = config.consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.metrics = Metrics()
        self._signer = Signer(config.secret)
        self._pool = Pool(parse_redis_url(config.redis_url), timeout_s=config.redis_timeout_s)
        self._tasks = keys.task_stream(config.queue)
        self._dead = keys.dead_stream(config.queue)
        self._held: dict[bytes, _Held] = {}
        self._running: dict[tuple[str, str], _Held] = {}
        self._cancelled: dict[tuple[str, str], float] = {}
        self._outgoing: list[_Outcome] = []
        self._outgoing_ready: anyio.Event | None = None
        self._capacity: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._intake: anyio.CancelScope | None = None
        self._handlers: anyio.abc.TaskGroup | None = None
        self._threads = anyio.CapacityLimiter(config.concurrency)
        self._max_bulk = config.limits.max_message_bytes + keys.BULK_MARGIN
        self._entry_bytes = _ASSUMED_ENTRY
        self._clock_offset_ms = 0.0
        self._connected = False
        self._connecting: anyio.CancelScope | None = None
        self._last_redis_ok = 0.0
        self._last_redis_error = 0.0
        self._last_warning: dict[str, float] = {}
        self._reading = False
        self._flushing = 0
        self._draining = False
        self._started_at = time.time()
        self._drained = False
        self._tick_ms = max(50, config.lease_ms // 4)
        self._beat_s = min(config.lease_ms / 3000, 5.0)

    # -- lifecycle -----------------------------------------------------------------
    async def serve(
        self,
        *,
        handle_signals: bool = False,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled or drained; ``task_status.started()`` once connected.

        Raises ``RedisConnectionLost`` if Redis did not answer within
        ``connect_timeout_s`` (when set).
        """
        self._outgoing_ready = anyio.Event()
        self._capacity = anyio.Event()
        self._idle = anyio.Event()
        self._intake = anyio.CancelScope()
        self._connecting = anyio.CancelScope()
        if self._draining:
            self._intake.cancel()
            self._connecting.cancel()
        # This process builds models from specs in tasks with its own API key: only the
        # allowed base URLs may receive it (the restriction is lifted when serving ends).
        restriction = restrict_base_urls(self.config.allowed_base_urls)
        connect_error: RedisConnectionLost | None = None
        try:
            async with anyio.create_task_group() as services:
                if handle_signals:
                    services.start_soon(self._signal_watcher)
                if self.config.health_port is not None:
                    await services.start(
                        functools.partial(
                            serve_health,
                            self.config.health_host,
                            self.config.health_port,
                            self.health,
                            self.metrics.render,
                            live=self.liveness,
                        )
                    )
                if self.config.metrics_dir:
                    services.start_soon(self._reporter)
                with self._connecting:
                    try:
                        await self._connect()
                    except RedisConnectionLost as exc:
                        connect_error = exc
                if not self._connected:  # gave up, or drained before Redis answered
                    task_status.started()
                    services.cancel_scope.cancel()
                else:
                    await self._serve_connected(services, task_status)
        finally:
            restriction.remove()
            if self._connected:
                with anyio.CancelScope(shield=True):
                    await self._leave()
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
        if connect_error is not None:
            raise connect_error
        log.info("worker %s stopped", self.consumer)

    async def _serve_connected(
        self, services: anyio.abc.TaskGroup, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        services.start_soon(self._reply_flusher)
        services.start_soon(self._cancel_watcher)
        services.start_soon(self._lease_renewer)
        services.start_soon(self._heartbeat)
        async with anyio.create_task_group() as handlers:
            self._handlers = handlers
            assert self._intake is not None
            with self._intake:
                async with anyio.create_task_group() as intake:
                    intake.start_soon(self._reader)
                    intake.start_soon(self._reclaimer)
                    task_status.started()
            log.info("worker %s draining: %d task(s) held", self.consumer, len(self._held))
            with anyio.move_on_after(self.config.drain_timeout_s):
                while self._held:
                    self._idle = anyio.Event()
                    await self._idle.wait()
            self._drained = not self._held
            handlers.cancel_scope.cancel()
        await self._release_unfinished()
        services.cancel_scope.cancel()

    def _info_json(self) -> str:
        """What ``asyncgraph status`` shows of this worker (plain JSON, never code)."""
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": self.config.concurrency,
                "in_flight": len(self._held),
                "version": asyncgraph.__version__,
                "draining": self._draining,
                "started": self._started_at,
            }
        )

    async def _leave(self) -> None:
        """On the way out: drop the heartbeat; after a full drain, the consumer too (bounded)."""
        with anyio.move_on_after(self.config.redis_timeout_s):
            try:
                await self._pool.pipeline(
                    [
                        ["HDEL", keys.workers_hash(self.config.queue), self.consumer],
                        ["HDEL", keys.workers_info_hash(self.config.queue), self.consumer],
                    ]
                )
                if self._drained and await self._delete_consumer(self.consumer):
                    log.info("worker %s: left the consumer group (nothing pending)", self.consumer)
            except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                log.warning("worker %s: leaving the group: %s", self.consumer, exc)

    async def _delete_consumer(self, name: str | bytes) -> bool:
        """XGROUP DELCONSUMER ``name`` if it holds no pending entry; True if deleted.

        DELCONSUMER drops the consumer's pending entries with it (they could never be
        reclaimed), hence the check first. The two are not atomic (WATCH does not see
        deliveries): that is safe for this worker's own consumer once its reader has
        stopped, and for another one only because the sweep picks consumers without a
        live heartbeat that have received nothing for 10 leases (a dead worker's). In
        the unlikely case that such a worker is alive after all and gets a task in
        between, it still runs and answers it; only a crash of that worker before it
        answers would leave the task unreclaimed (its caller times out).
        """
        held = await self._pool.execute("XPENDING", self._tasks, keys.GROUP, "-", "+", 1, name)
        if held:
            return False
        await self._pool.execute("XGROUP", "DELCONSUMER", self._tasks, keys.GROUP, name)
        return True

    def drain(self) -> None:
        """Stop reading tasks; ``serve`` returns once the held ones are done."""
        self._draining = True
        for scope in (self._connecting, self._intake):
            if scope is not None:
                scope.cancel()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: connected, Redis answering lately, not draining (the /readyz answer)."""
        now = time.monotonic()
        age = now - self._last_redis_ok
        redis_ok = (
            self._connected
            and self._last_redis_ok >= self._last_redis_error
            and age < max(3 * self._beat_s, 10.0)
        )
        ok = redis_ok and not self._draining
        if self._draining:
            status = "draining"
        elif not self._connected:
            status = "connecting to Redis"
        else:
            status = "ok" if ok else "redis unreachable"
        return ok, {
            "status": status,
            "consumer": self.consumer,
            "queue": self.config.queue,
            "in_flight": len(self._held),
            "concurrency": self.config.concurrency,
            "redis_ok_age_s": round(age, 3) if self._last_redis_ok else None,
            "functions": sorted(self.registry),
        }

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the process and its event loop answer (not tied to Redis: /livez)."""
        return True, {"status": "alive", "consumer": self.consumer}

    async def _connect(self) -> None:
        """Set up the group and the clock, retrying with backoff until Redis answers."""
        timeout_s = self.config.connect_timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s else None
        backoff = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._setup()
            except (RedisConnectionLost, ReplyError) as exc:
                self.metrics.inc("asyncgraph_worker_redis_errors_total")
                self._last_redis_error = time.monotonic()
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
            self._connected = True
            if attempt > 1:
                log.info(
                    "worker %s: connected to Redis at %s", self.consumer, self._pool.address.display
                )
            return

    async def _setup(self) -> None:
        await self._ensure_group()
        await self._sync_clock()

    async def _ensure_group(self) -> None:
        try:
            await self._pool.execute("XGROUP", "CREATE", self._tasks, keys.GROUP, "0", "MKSTREAM")
        except ReplyError as exc:
            if exc.code != "BUSYGROUP":
                raise

    async def _sync_clock(self) -> None:
        before = time.time()
        seconds, micros = await self._pool.execute("TIME")
        after = time.time()
        redis_ms = int(seconds) * 1000 + int(micros) / 1000
        self._clock_offset_ms = redis_ms - (before + after) * 500
        self._last_redis_ok = time.monotonic()

    def _redis_now_ms(self) -> float:
        return time.time() * 1000 + self._clock_offset_ms

    # -- intake --------------------------------------------------------------------
    def _read_count(self, free: int) -> int:
        """Entries to ask for: free slots, the batch size, and the read budget."""
        return max(1, min(free, self.config.batch_size, _READ_BUDGET // self._entry_bytes))

    def _note_sizes(self, entries: list[Any]) -> None:
        """Remember how big the entries just read were (for the next read's count)."""
        largest = _ASSUMED_ENTRY
        for entry in entries:
            if entry is None or not isinstance(entry[1], list):
                continue
            for value in entry[1]:
                size = (
                    value.size
                    if isinstance(value, Oversize)
                    else (len(value) if isinstance(value, bytes) else 0)
                )
                largest = max(largest, min(size, self._max_bulk))
        self._entry_bytes = largest

    async def _wait_capacity(self) -> int:
        while True:
            free = self.config.concurrency - len(self._held)
            if free > 0:
                return self._read_count(free)
            self._capacity = anyio.Event()
            await self._capacity.wait()

    async def _reader(self) -> None:  # noqa: C901 (the read loop; to split into intake and admission)
        conn: Connection | None = None
        backoff = 0.05
        try:
            while True:
                count = await self._wait_capacity()
                try:
                    if conn is None:
                        conn = await self._pool.connect()
                    with anyio.fail_after(_BLOCK_MS / 1000 + self.config.redis_timeout_s):
                        reply = await conn.execute(
                            "XREADGROUP",
                            "GROUP",
                            keys.GROUP,
                            self.consumer,
                            "COUNT",
                            count,
                            "BLOCK",
                            _BLOCK_MS,
                            "STREAMS",
                            self._tasks,
                            ">",
                            max_bulk=self._max_bulk,
                        )
                    backoff = 0.05
                except (RedisConnectionLost, TimeoutError, ReplyError) as exc:
                    if isinstance(exc, ReplyError) and exc.code == "NOGROUP":
                        # The stream was deleted, or Redis restarted empty: start over.
                        if await self._redis_step(self._ensure_group, "creating the group"):
                            continue
                    else:
                        self._redis_failed("reading tasks", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                self._redis_ok()
                if reply:
                    self._note_sizes(reply[0][1])
                    self._reading = True
                    try:
                        for entry_id, fields in reply[0][1]:
                            self._take(entry_id, fields, 1)
                        # Let the tasks just started take their first step. Those that
                        # finish at once queue their replies for this reader, which sends
                        # them before its next blocking read: writing to Redis first would
                        # wake the server, which can take this CPU while the replies wait.
                        await let_ready_tasks_run()
                    finally:
                        self._reading = False
                    if self._outgoing:
                        if self._flushing:
                            assert self._outgoing_ready is not None
                            self._outgoing_ready.set()
                        elif not await self._flush_replies():
                            assert self._outgoing_ready is not None
                            self._outgoing_ready.set()  # the flusher retries with backoff
        finally:
            if self._outgoing and self._outgoing_ready is not None:
                self._outgoing_ready.set()  # never strand settled tasks when intake stops
            if conn is not None:
                await conn.aclose()

    async def _reclaimer(self) -> None:
        """Take over tasks whose holder stopped renewing its lease (dead or stuck)."""
        cursor: bytes | str = "0-0"
        while True:
            await anyio.sleep(self._tick_ms / 1000)
            free = self.config.concurrency - len(self._held)
            if free <= 0:
                continue
            try:
                reply = await self._pool.execute(
                    "XAUTOCLAIM",
                    self._tasks,
                    keys.GROUP,
                    self.consumer,
                    self.config.lease_ms,
                    cursor,
                    "COUNT",
                    self._read_count(free),
                    max_bulk=self._max_bulk,
                )
                scanned_from, cursor = cursor, reply[0]
                self._note_sizes(reply[1])
                entries = [(e[0], e[1]) for e in reply[1] if e is not None]
                # Entries deleted from the stream while pending (a cancelled task whose
                # holder died): Redis >= 7 lists their ids apart, Redis 6.2 returns nil.
                gone = [e[0] for e in reply[1] if e is not None and e[1] is None]
                if len(reply) > 2 and reply[2]:
                    gone += list(reply[2])
                elif any(e is None for e in reply[1]):
                    gone += await self._claimed_but_deleted(scanned_from, entries)
                entries = [(i, f) for i, f in entries if f is not None and i not in self._held]
                if gone:
                    await self._pool.execute("XACK", self._tasks, keys.GROUP, *gone)
                if not entries:
                    continue
                counts = await self._pool.pipeline(
                    [["XPENDING", self._tasks, keys.GROUP, i, i, 1] for i, _ in entries]
                )
            except (RedisConnectionLost, ReplyError) as exc:
                if isinstance(exc, ReplyError) and exc.code == "NOGROUP":
                    await self._redis_step(self._ensure_group, "creating the group")
                else:
                    self._redis_failed("reclaiming tasks", exc)
                continue
            for (entry_id, fields), pending in zip(entries, counts, strict=True):
                deliveries = int(pending[0][3]) if isinstance(pending, list) and pending else 2
                self.metrics.inc("asyncgraph_worker_reclaimed_total")
                log.info(
                    "worker %s reclaimed task entry %s (delivery %d)",
                    self.consumer,
                    entry_id.decode(),
                    deliveries,
                )
                self._take(entry_id, fields, deliveries)

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
            self._tasks,
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
            and row[0] not in self._held
            and int(row[2]) < self.config.lease_ms
        ]

    def _redis_ok(self) -> None:
        self._last_redis_ok = time.monotonic()

    def _redis_failed(self, doing: str, exc: Exception) -> None:
        self.metrics.inc("asyncgraph_worker_redis_errors_total")
        now = time.monotonic()
        if isinstance(exc, (RedisConnectionLost, TimeoutError)):
            self._last_redis_error = now
        if now - self._last_warning.get(doing, -1e9) >= 10.0:  # one line per outage, not a flood
            self._last_warning[doing] = now
            log.warning("worker %s: %s: %s", self.consumer, doing, exc)

    async def _redis_step(self, step: Any, doing: str) -> bool:
        """Run ``await step()``; on a Redis error log it and return False (the loop retries)."""
        try:
            await step()
        except (RedisConnectionLost, ReplyError) as exc:
            self._redis_failed(doing, exc)
            return False
        return True

    def _take(self, entry_id: bytes, fields: Any, deliveries: int) -> None:
        if entry_id in self._held:
            return
        held = self._held[entry_id] = _Held(entry_id)
        admitted = self._admit(held, fields, deliveries)
        if admitted is None:
            return
        message, registered, data = admitted
        assert self._handlers is not None
        self._handlers.start_soon(self._run, held, message, registered, data)

    # -- one task --------------------------------------------------------------------
    def _admit(
        self, held: _Held, fields: Any, deliveries: int
    ) -> tuple[TaskMessage, RegisteredFunction, dict[Any, Any]] | None:
        """Decode and check one entry; None when it was settled here (rejected, skipped...)."""
        data: dict[Any, Any] = {}
        if isinstance(fields, list):
            data = dict(zip(fields[::2], fields[1::2], strict=False))
        packed, signature = data.get(keys.F_MESSAGE), data.get(keys.F_SIGNATURE)
        oversize = [v for v in (*data, *data.values()) if isinstance(v, Oversize)]
        if oversize or len(data) > 16:
            # Skipped unread (see wire._resp): nothing of it can be verified. Without a
            # secret (anyone may write any task anyway) the entry's hints say whom to tell.
            text = (
                f"entry has a field of {oversize[0].size} bytes, above this worker's "
                f"limit of {self.config.limits.max_message_bytes} (max_message_bytes); "
                f"it was not read"
                if oversize
                else f"entry has {len(data)} fields"
            )
            dead = self._dead_letter(
                held, keys.REASON_OVERSIZE if oversize else keys.REASON_MALFORMED, text, data
            )
            ids = None if self._signer.enabled else _hinted_ids(data)
            if ids is None:
                self._finish(held, "rejected", [dead])
            else:
                self._reply_error(
                    held,
                    *ids,
                    ErrorInfo(
                        "invalid",
                        "WireError",
                        f"worker {self.consumer} of queue "
                        f"{self.config.queue!r} refused the task: {text}; send less data or raise "
                        f"--max-message-bytes on the workers",
                    ),
                    "rejected",
                    dead,
                )
            return None
        try:
            message = decode(packed, signature, self._signer, self.config.queue, self.config.limits)
            if not isinstance(message, TaskMessage):
                raise WireError(f"a {type(message).__name__} in the task stream")
        except WireError as exc:
            self._refuse(held, data, packed, signature, exc)
            return None
        key = (message.client, message.id)
        held.key = key
        if key in self._cancelled:
            self._finish(held, "cancelled")
            return None
        held.deadline = self._deadline(held.entry_id, message.ttl_ms)
        if held.deadline <= anyio.current_time():
            self._finish(held, "expired")
            return None
        if deliveries > self.config.max_attempts:
            text = (
                f"task {message.id} of {message.function!r} was delivered {deliveries} times "
                f"without completing (each worker holding it died or lost its lease); "
                f"max_attempts is {self.config.max_attempts}: moved to the dead-letter stream "
                f"{self._dead!r}"
            )
            self._reply_error(
                held,
                message.client,
                message.id,
                ErrorInfo("dead_letter", "DeadLetter", text),
                "dead_letter",
                self._dead_letter(held, keys.REASON_MAX_ATTEMPTS, text, data),
            )
            return None
        registered = self.registry.get(message.function)
        if registered is None:
            served = ", ".join(sorted(self.registry)) or "nothing"
            self._reply_error(
                held,
                message.client,
                message.id,
                ErrorInfo(
                    "unknown_function",
                    "LookupError",
                    f"function {message.function!r} is not served by the workers of queue "
                    f"{self.config.queue!r} (worker {self.consumer} serves: {served}); start the "
                    f"workers with --import <the module defining it>, or set remote_name",
                ),
                "unknown_function",
            )
            return None
        if registered.fingerprint != message.fingerprint:
            self._reply_error(
                held,
                message.client,
                message.id,
                ErrorInfo(
                    "fingerprint",
                    "LookupError",
                    f"function {message.function!r} on queue {self.config.queue!r} has fingerprint "
                    f"{registered.fingerprint} on worker {self.consumer} but {message.fingerprint} on "
                    f"the client: they run different code; deploy the same version to both",
                ),
                "fingerprint",
            )
            return None
        return message, registered, data

    def _refuse(
        self, held: _Held, data: dict[Any, Any], packed: Any, signature: Any, exc: WireError
    ) -> None:
        """Dead-letter an entry that does not decode; answer its client when it may be trusted.

        A message whose signature does not check out is never answered: a reply would
        be signed by this worker on behalf of whoever wrote the entry.
        """
        forged = (
            isinstance(packed, bytes)
            and self._signer.verify(packed, signature if isinstance(signature, bytes) else None)
            is not None
        )
        reason = keys.REASON_FORGED if forged else keys.REASON_MALFORMED
        dead = self._dead_letter(held, reason, str(exc), data)
        ids = None if forged else peek_ids(packed, self.config.queue, "task")
        if ids is None:
            self._finish(held, "rejected", [dead])
            return
        self._reply_error(
            held,
            *ids,
            ErrorInfo(
                "invalid",
                "WireError",
                f"worker {self.consumer} of queue {self.config.queue!r} refused the task: {exc}",
            ),
            "rejected",
            dead,
        )

    async def _run(
        self,
        held: _Held,
        message: TaskMessage,
        registered: RegisteredFunction,
        data: dict[Any, Any],
    ) -> None:
        """Run an async (or threaded) task under its deadline; a cancel message stops it."""
        assert held.key is not None
        started = time.perf_counter()
        result: Any = None
        error: Exception | None = None
        with anyio.CancelScope(deadline=held.deadline) as scope, track_usage() as usage:
            held.scope = scope
            self._running[held.key] = held
            try:
                result = await self._execute(registered, message)
            except Exception as exc:
                error = exc
            finally:
                self._running.pop(held.key, None)
        if scope.cancelled_caught:
            self._finish(held, "cancelled" if held.key in self._cancelled else "expired")
            return
        spent = usage.snapshot()
        self._complete(
            held,
            message,
            data,
            started,
            result,
            error,
            spent.to_dict() if spent != Usage() else None,
        )

    def _complete(
        self,
        held: _Held,
        message: TaskMessage,
        data: dict[Any, Any],
        started: float,
        result: Any,
        error: Exception | None,
        usage: dict[str, int | float] | None = None,
    ) -> None:
        """Queue the reply: the result, or the error with this worker's traceback."""
        self.metrics.observe("asyncgraph_worker_task_seconds", time.perf_counter() - started)
        if error is not None:
            tb = "".join(traceback.format_exception(error))[-_MAX_TRACEBACK:]
            info = ErrorInfo("error", type(error).__qualname__, str(error)[:_MAX_TRACEBACK], tb)
            self._reply_error(
                held,
                message.client,
                message.id,
                info,
                "error",
                self._dead_letter(
                    held, keys.REASON_ERROR, f"{type(error).__qualname__}: {error}\n{tb}", data
                ),
                usage=usage,
            )
            return
        reply = ReplyMessage(
            self.config.queue, message.client, message.id, self.consumer, result, usage=usage
        )
        try:
            packed, signature = encode(reply, self._signer, self.config.limits)
        except (TypeError, WireError) as exc:
            self._reply_error(
                held,
                message.client,
                message.id,
                ErrorInfo(
                    "error",
                    type(exc).__qualname__,
                    f"{message.function}.{message.op} returned a value that cannot be sent back: {exc}",
                ),
                "error",
            )
            return
        self._reply(held, message.client, message.id, packed, signature, "ok")

    async def _execute(self, registered: RegisteredFunction, message: TaskMessage) -> Any:
        fn = registered.function
        payload = message.payload
        if message.op == "backward":
            ctx = ctx_from_state(payload.get("ctx"), fn)
            grads = grads_from_entries(payload.get("g"), "grad_outputs")
            with no_grad():
                result = await self._call(fn, fn.backward, ctx, *grads)
            return result_entries(result)
        args, kwargs, needs = forward_args(payload)
        ctx = FunctionCtx()
        ctx._function_name = fn.__name__
        ctx.needs_input_grad = needs
        inputs = args + tuple(kwargs.values())
        with no_grad():
            if fn._uses_setup_context:
                output = await self._call(fn, fn.forward, *args, **kwargs)
                await self._call(fn, fn.setup_context, ctx, inputs, output)
            else:
                output = await self._call(fn, fn.forward, ctx, *args, **kwargs)
        is_tuple = isinstance(output, tuple)
        outputs = output if is_tuple else (output,)
        non_diff = ctx._non_differentiable
        return {
            "out": result_entries(tuple(outputs)),
            "tuple": is_tuple,
            "ctx": ctx_state(ctx),
            "nd": [i for i, o in enumerate(outputs) if any(o is n for n in non_diff)],
        }

    async def _call(self, fn: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Await an async method; run a synchronous one in a worker thread.

        On a worker every synchronous method goes to a thread, whatever ``blocking``
        says: a remote function is slow by nature, and one that held the event loop
        would stall lease renewals (its task would be reclaimed and run twice),
        heartbeats, cancellations and every other task of the batch.
        """
        if inspect.iscoroutinefunction(method):
            return await method(*args, **kwargs)

        def in_thread() -> Any:
            with no_grad():  # grad mode is a contextvar: set it in the thread too
                return method(*args, **kwargs)

        return await anyio.to_thread.run_sync(in_thread, limiter=self._threads)

    def _deadline(self, entry_id: bytes, ttl_ms: int) -> float:
        """The task's deadline on this process's anyio clock (entry ids are Redis time)."""
        try:
            enqueued_ms = int(entry_id.split(b"-", 1)[0])
        except ValueError:
            enqueued_ms = int(self._redis_now_ms())
        remaining_s = (enqueued_ms + ttl_ms - self._redis_now_ms()) / 1000
        return anyio.current_time() + remaining_s

    # -- replies, acknowledgements, dead letters -------------------------------------------
    def _reply(
        self,
        held: _Held,
        client: str,
        task_id: str,
        packed: bytes,
        signature: bytes,
        outcome: str,
        *extra: list[Any],
    ) -> None:
        stream = keys.reply_stream(self.config.queue, client)
        self._finish(
            held,
            outcome,
            [
                [
                    "XADD",
                    stream,
                    "*",
                    keys.F_MESSAGE,
                    packed,
                    keys.F_SIGNATURE,
                    signature,
                    keys.F_TASK_HINT,
                    task_id,
                ],
                *extra,
            ],
            stream,
        )

    def _reply_error(
        self,
        held: _Held,
        client: str,
        task_id: str,
        info: ErrorInfo,
        outcome: str,
        *extra: list[Any],
        usage: dict[str, int | float] | None = None,
    ) -> None:
        reply = ReplyMessage(
            self.config.queue, client, task_id, self.consumer, error=info, usage=usage
        )
        packed, signature = encode(reply, self._signer)
        self._reply(held, client, task_id, packed, signature, outcome, *extra)

    def _dead_letter(self, held: _Held, reason: str, text: str, data: dict[Any, Any]) -> list[Any]:
        """The XADD that dead-letters ``held`` with its reason and (truncated) original message."""
        self.metrics.inc("asyncgraph_worker_dead_letters_total", reason=reason)
        log.warning(
            "worker %s dead-lettered entry %s (%s): %.300s",
            self.consumer,
            held.entry_id.decode(errors="replace"),
            reason,
            text,
        )
        fields: list[Any] = [
            keys.F_REASON,
            reason,
            keys.F_ERROR,
            text[:_MAX_TRACEBACK],
            keys.F_WORKER,
            self.consumer,
            keys.F_TASK,
            held.entry_id,
        ]
        # Whose task it was (for that client's timeout diagnosis): from the message when
        # it can be read, else from the entry's hint. Informational, never trusted.
        original = data.get(keys.F_MESSAGE)
        ids = peek_ids(original, self.config.queue, "task")
        hint = data.get(keys.F_CLIENT_HINT)
        client = (
            ids[0]
            if ids is not None
            else (hint.decode(errors="replace")[:32] if isinstance(hint, bytes) else None)
        )
        if client is not None and keys.is_client_id(client):
            fields += [keys.F_CLIENT, client]
        if isinstance(original, bytes):
            fields += [keys.F_ORIGINAL, original[:_MAX_ORIGINAL]]
        return ["XADD", self._dead, "MAXLEN", "~", keys.DEAD_MAXLEN, "*", *fields]

    def _finish(
        self,
        held: _Held,
        outcome: str,
        commands: list[list[Any]] | None = None,
        reply_stream: str | None = None,
    ) -> None:
        """Queue the reply (if any) and the acknowledgement: written together by the flusher."""
        self.metrics.inc("asyncgraph_worker_tasks_total", outcome=outcome)
        self._outgoing.append(_Outcome(held, commands or [], reply_stream))
        if not self._reading:  # else the reader flushes its batch itself, one hop sooner
            assert self._outgoing_ready is not None
            self._outgoing_ready.set()

    async def _reply_flusher(self) -> None:
        """Write what finished while no flush was running (async tasks, retries)."""
        backoff = 0.05
        while True:
            assert self._outgoing_ready is not None
            await self._outgoing_ready.wait()
            self._outgoing_ready = anyio.Event()
            if await self._flush_replies():
                backoff = 0.05
            else:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                self._outgoing_ready.set()

    async def _flush_replies(self) -> bool:
        """One MULTI: replies, dead letters, EXPIREs, XACK + XDEL. False if Redis failed."""
        batch, self._outgoing = self._outgoing, []
        if not batch:
            return True
        self._flushing += 1
        try:
            ids = [o.held.entry_id for o in batch]
            commands: list[list[Any]] = [["MULTI"]]
            for outcome in batch:
                commands.extend(outcome.commands)
            # Reply streams of clients that died expire; one EXPIRE per stream per batch.
            for stream in dict.fromkeys(o.reply_stream for o in batch if o.reply_stream):
                commands.append(["EXPIRE", stream, keys.REPLY_TTL_S])
            commands += [
                ["XACK", self._tasks, keys.GROUP, *ids],
                ["XDEL", self._tasks, *ids],
                ["EXEC"],
            ]
            try:
                # Shielded (bounded by the pool's deadline): cut in the middle, the
                # replies would be written without their acknowledgements.
                replies = await self._pool.pipeline(commands, shield=True)
            except RedisConnectionLost as exc:
                self._redis_failed(f"writing {len(batch)} repl(ies) (will retry)", exc)
                self._outgoing[:0] = batch
                return False
        finally:
            self._flushing -= 1
        if isinstance(replies[-1], ReplyError):
            log.warning("worker %s: reply transaction failed: %s", self.consumer, replies[-1])
        self._redis_ok()
        for outcome in batch:
            self._held.pop(outcome.held.entry_id, None)
        self._on_released()
        return True

    def _on_released(self) -> None:
        self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._held))
        if self._capacity is not None:
            self._capacity.set()
        if not self._held and self._idle is not None:
            self._idle.set()

    async def _release_unfinished(self) -> None:
        """After a drain that timed out: make held tasks reclaimable by others at once."""
        leftover = [h.entry_id for h in self._held.values()]
        if not leftover:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.redis_timeout_s):
            try:
                await self._pool.execute(
                    "XCLAIM",
                    self._tasks,
                    keys.GROUP,
                    self.consumer,
                    0,
                    *leftover,
                    "IDLE",
                    self.config.lease_ms * 10,
                    "JUSTID",
                )
                log.info("worker %s released %d unfinished task(s)", self.consumer, len(leftover))
            except (RedisConnectionLost, ReplyError) as exc:
                log.warning("worker %s: releasing unfinished tasks: %s", self.consumer, exc)

    # -- background --------------------------------------------------------------------
    async def _lease_renewer(self) -> None:
        period = self.config.lease_ms / 3000
        while True:
            await anyio.sleep(period)
            ids = list(self._held)
            if not ids:
                continue
            try:
                await self._pool.execute(
                    "XCLAIM", self._tasks, keys.GROUP, self.consumer, 0, *ids, "JUSTID"
                )
            except (RedisConnectionLost, ReplyError) as exc:
                self._redis_failed("renewing leases", exc)
            else:
                self._redis_ok()

    async def _heartbeat(self) -> None:
        period = self._beat_s
        workers = keys.workers_hash(self.config.queue)
        housekeeping_s = min(30.0, _CONSUMER_IDLE_LEASES * self.config.lease_ms / 1000)
        last_housekeeping = time.monotonic()
        while True:
            try:
                await self._sync_clock()
                expiry = int(self._redis_now_ms() + 3 * period * 1000 + 1000)
                await self._pool.pipeline(
                    [
                        ["HSET", workers, self.consumer, expiry],
                        [
                            "HSET",
                            keys.workers_info_hash(self.config.queue),
                            self.consumer,
                            self._info_json(),
                        ],
                    ]
                )
                self._redis_ok()
                now = time.monotonic()
                if now - last_housekeeping >= housekeeping_s:
                    last_housekeeping = now
                    await self._housekeeping(workers)
            except (RedisConnectionLost, ReplyError, ValueError, TimeoutError) as exc:
                self._redis_failed("heartbeat", exc)
            if self.config.supervisor_pid and os.getppid() != self.config.supervisor_pid:
                log.warning(
                    "worker %s: supervisor %d is gone, draining",
                    self.consumer,
                    self.config.supervisor_pid,
                )
                self.drain()
            now = time.monotonic()
            for task_key, until in list(self._cancelled.items()):
                if until < now:
                    del self._cancelled[task_key]
            self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._held))
            await anyio.sleep(period)

    async def _housekeeping(self, workers: str) -> None:
        """Forget stale heartbeats; delete consumers long idle, holding nothing, not alive."""
        now_ms = self._redis_now_ms()
        beats = await self._pool.execute("HGETALL", workers)
        alive = {beats[i] for i in range(0, len(beats), 2) if int(beats[i + 1]) >= now_ms}
        stale = [
            beats[i] for i in range(0, len(beats), 2) if int(beats[i + 1]) < now_ms - _STALE_BEAT_MS
        ]
        if stale:
            await self._pool.pipeline(
                [
                    ["HDEL", workers, *stale],
                    ["HDEL", keys.workers_info_hash(self.config.queue), *stale],
                ]
            )
        idle_limit_ms = _CONSUMER_IDLE_LEASES * self.config.lease_ms
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
            if await self._delete_consumer(name):
                log.info(
                    "worker %s: deleted consumer %s (idle %d ms, nothing pending, no heartbeat)",
                    self.consumer,
                    name.decode(errors="replace"),
                    int(fields[b"idle"]),
                )

    async def _reporter(self) -> None:
        """Under a supervisor: write metrics and health to its directory every second."""
        assert self.config.metrics_dir is not None
        while True:
            self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._held))
            try:
                self.metrics.write_snapshot(self.config.metrics_dir, health=self.health())
            except OSError as exc:
                log.warning("worker %s: writing metrics: %s", self.consumer, exc)
            await anyio.sleep(1.0)

    async def _cancel_watcher(self) -> None:
        """Follow the cancel stream: remember cancelled tasks, stop the ones running."""
        stream = keys.cancel_stream(self.config.queue)
        # Look back a little: a cancel may predate this worker and the tasks it reclaims.
        last_id: bytes | str = f"{max(0, int(self._redis_now_ms()) - 2 * self.config.lease_ms)}-0"
        conn: Connection | None = None
        try:
            while True:
                try:
                    if conn is None:
                        conn = await self._pool.connect()
                    with anyio.fail_after(_BLOCK_MS / 1000 + self.config.redis_timeout_s):
                        reply = await conn.execute(
                            "XREAD",
                            "COUNT",
                            512,
                            "BLOCK",
                            _BLOCK_MS,
                            "STREAMS",
                            stream,
                            last_id,
                            max_bulk=self._max_bulk,
                        )
                except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                    self._redis_failed("reading cancellations", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(0.5)
                    continue
                self._redis_ok()
                if not reply:
                    continue
                for entry_id, fields in reply[0][1]:
                    last_id = entry_id
                    data = dict(zip(fields[::2], fields[1::2], strict=False))
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
                        self.metrics.inc(
                            "asyncgraph_worker_dead_letters_total", reason="bad_cancel"
                        )
                        log.warning("worker %s: ignored a cancel entry: %s", self.consumer, exc)
                        continue
                    until = time.monotonic() + _CANCEL_MEMORY_S
                    for task_id in message.ids:
                        task_key = (message.client, task_id)
                        self._cancelled[task_key] = until
                        held = self._running.get(task_key)
                        if held is not None and held.scope is not None:
                            held.scope.cancel()
        finally:
            if conn is not None:
                await conn.aclose()

    async def _signal_watcher(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._draining:
                    log.warning("worker %s: second signal, stopping now", self.consumer)
                    if self._handlers is not None:
                        self._handlers.cancel_scope.cancel()
                    return
                log.info("worker %s: %s, draining", self.consumer, signal.Signals(signum).name)
                self.drain()
