"""The worker loop: serve remote backwards (and forwards) from one Redis queue.

Delivery is at-least-once with idempotent completion:

- tasks are read in batches with XREADGROUP, never more than ``concurrency``
  held at once;
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
  dead-lettered with the reason, and the loop goes on.
"""

from __future__ import annotations

import functools
import inspect
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

from .._exceptions import WireError
from .._function import FunctionCtx
from .._grad_mode import no_grad
from ..models._usage import Usage, track_usage
from ..wire import _keys as keys
from ..wire._codec import DEFAULT_LIMITS, Limits
from ..wire._payload import (
    ctx_from_state,
    ctx_state,
    forward_args,
    grads_from_entries,
    result_entries,
)
from ..wire._resp import Connection, Pool, RedisConnectionLost, ReplyError, parse_redis_url
from ..wire._schema import CancelMessage, ErrorInfo, ReplyMessage, TaskMessage, decode, encode
from ..wire._signing import Signer
from ._health import serve_health
from ._metrics import Metrics
from ._registry import RegisteredFunction, Registry

__all__ = ["Worker", "WorkerConfig"]

log = logging.getLogger("asyncgraph.worker")

_BLOCK_MS = 2000
_MAX_ORIGINAL = 65_536
_MAX_TRACEBACK = 32_768
_CANCEL_MEMORY_S = 3600.0


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process (the ``asyncgraph worker`` flags)."""

    redis_url: str
    queue: str = "grads"
    concurrency: int = 64
    secret: str | None = None
    lease_ms: int = 10_000
    max_attempts: int = 3
    batch_size: int = 256
    redis_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    health_host: str = "0.0.0.0"
    health_port: int | None = None
    consumer: str | None = None
    metrics_dir: str | None = None
    supervisor_pid: int | None = None
    limits: Limits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        keys.check_queue_name(self.queue)
        for name in ("concurrency", "lease_ms", "max_attempts", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.lease_ms < 200:
            raise ValueError(f"lease_ms must be at least 200, got {self.lease_ms}")


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


class Worker:
    """Serves ``registry`` on ``config.queue`` until cancelled or drained (SIGTERM).

    ``await Worker(config, registry).serve()``; ``drain()`` stops taking tasks
    and lets the ones held finish (at most ``drain_timeout_s``).
    """

    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.consumer = config.consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
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
        self._clock_offset_ms = 0.0
        self._last_redis_ok = 0.0
        self._last_warning: dict[str, float] = {}
        self._reading = False
        self._flushing = 0
        self._draining = False
        self._tick_ms = max(50, config.lease_ms // 4)

    # -- lifecycle -----------------------------------------------------------------
    async def serve(
        self,
        *,
        handle_signals: bool = False,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        self._outgoing_ready = anyio.Event()
        self._capacity = anyio.Event()
        self._idle = anyio.Event()
        self._intake = anyio.CancelScope()
        if self._draining:
            self._intake.cancel()
        await self._setup()
        try:
            async with anyio.create_task_group() as services:
                services.start_soon(self._reply_flusher)
                services.start_soon(self._cancel_watcher)
                services.start_soon(self._lease_renewer)
                services.start_soon(self._heartbeat)
                if handle_signals:
                    services.start_soon(self._signal_watcher)
                if self.config.health_port is not None:
                    await services.start(
                        functools.partial(serve_health, self.config.health_host,
                                          self.config.health_port, self.health,
                                          self.metrics.render))
                async with anyio.create_task_group() as handlers:
                    self._handlers = handlers
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
                    handlers.cancel_scope.cancel()
                await self._release_unfinished()
                services.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(self.config.redis_timeout_s):
                    try:
                        await self._pool.execute("HDEL", keys.workers_hash(self.config.queue),
                                                 self.consumer)
                    except (RedisConnectionLost, ReplyError):
                        pass
                await self._pool.aclose()
        log.info("worker %s stopped", self.consumer)

    def drain(self) -> None:
        """Stop reading tasks; ``serve`` returns once the held ones are done."""
        self._draining = True
        if self._intake is not None:
            self._intake.cancel()

    def health(self) -> tuple[bool, dict[str, Any]]:
        age = time.monotonic() - self._last_redis_ok
        ok = age < max(3 * self._tick_ms / 1000, 10.0) and not self._draining
        return ok, {
            "status": "ok" if ok else ("draining" if self._draining else "redis unreachable"),
            "consumer": self.consumer,
            "queue": self.config.queue,
            "in_flight": len(self._held),
            "concurrency": self.config.concurrency,
            "redis_ok_age_s": round(age, 3),
            "functions": sorted(self.registry),
        }

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
    async def _wait_capacity(self) -> int:
        while True:
            free = self.config.concurrency - len(self._held)
            if free > 0:
                return min(free, self.config.batch_size)
            self._capacity = anyio.Event()
            await self._capacity.wait()

    async def _reader(self) -> None:
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
                            "XREADGROUP", "GROUP", keys.GROUP, self.consumer, "COUNT", count,
                            "BLOCK", _BLOCK_MS, "STREAMS", self._tasks, ">")
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
                self._last_redis_ok = time.monotonic()
                if reply:
                    self._reading = True
                    try:
                        for entry_id, fields in reply[0][1]:
                            self._take(entry_id, fields, 1)
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
                    "XAUTOCLAIM", self._tasks, keys.GROUP, self.consumer,
                    self.config.lease_ms, cursor, "COUNT", min(free, self.config.batch_size))
                scanned_from, cursor = cursor, reply[0]
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
                    [["XPENDING", self._tasks, keys.GROUP, i, i, 1] for i, _ in entries])
            except (RedisConnectionLost, ReplyError) as exc:
                if isinstance(exc, ReplyError) and exc.code == "NOGROUP":
                    await self._redis_step(self._ensure_group, "creating the group")
                else:
                    self._redis_failed("reclaiming tasks", exc)
                continue
            for (entry_id, fields), pending in zip(entries, counts, strict=True):
                deliveries = int(pending[0][3]) if isinstance(pending, list) and pending else 2
                self.metrics.inc("asyncgraph_worker_reclaimed_total")
                log.info("worker %s reclaimed task entry %s (delivery %d)",
                         self.consumer, entry_id.decode(), deliveries)
                self._take(entry_id, fields, deliveries)

    async def _claimed_but_deleted(self, scanned_from: bytes | str,
                                   entries: list[tuple[bytes, Any]]) -> list[bytes]:
        """Ids of deleted entries the last XAUTOCLAIM gave this consumer (Redis 6.2).

        They are ours now, were delivered before (count >= 2: never a fresh read in
        flight), lie in the scanned range and are neither held nor returned with data.
        """
        claimed = {i for i, _ in entries}
        rows = await self._pool.execute("XPENDING", self._tasks, keys.GROUP, scanned_from, "+",
                                        self.config.batch_size, self.consumer)
        return [row[0] for row in rows
                if int(row[3]) >= 2 and row[0] not in claimed and row[0] not in self._held
                and int(row[2]) < self.config.lease_ms]

    def _redis_failed(self, doing: str, exc: Exception) -> None:
        self.metrics.inc("asyncgraph_worker_redis_errors_total")
        now = time.monotonic()
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
        fn = registered.function
        if message.op == "backward" and not fn._backward_is_async and not fn.blocking:
            # Cheap synchronous backward: run it here, like the local executor runs it
            # inline (no task, no thread); it cannot be interrupted anyway.
            started = time.perf_counter()
            try:
                result = self._backward_sync(registered, message)
            except Exception as exc:
                self._complete(held, message, data, started, None, exc)
            else:
                self._complete(held, message, data, started, result, None)
            return
        assert self._handlers is not None
        self._handlers.start_soon(self._run, held, message, registered, data)

    # -- one task --------------------------------------------------------------------
    def _admit(
        self, held: _Held, fields: Any, deliveries: int
    ) -> tuple[TaskMessage, RegisteredFunction, dict[Any, Any]] | None:
        """Decode and check one entry; None when it was settled here (rejected, skipped...)."""
        data: dict[Any, Any] = {}
        try:
            if isinstance(fields, list):
                data = dict(zip(fields[::2], fields[1::2], strict=False))
            message = decode(data.get(keys.F_MESSAGE), data.get(keys.F_SIGNATURE), self._signer,
                             self.config.queue, self.config.limits)
            if not isinstance(message, TaskMessage):
                raise WireError(f"a {type(message).__name__} in the task stream")
        except WireError as exc:
            reason = "forged" if "signature" in str(exc) or "unsigned" in str(exc) else "malformed"
            self._finish(held, "rejected", [self._dead_letter(held, reason, str(exc), data)])
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
            text = (f"task {message.id} of {message.function!r} was delivered {deliveries} times "
                    f"without completing (each worker holding it died or lost its lease); "
                    f"max_attempts is {self.config.max_attempts}: moved to the dead-letter stream "
                    f"{self._dead!r}")
            self._reply_error(held, message, ErrorInfo("dead_letter", "DeadLetter", text),
                              "dead_letter", self._dead_letter(held, "max_attempts", text, data))
            return None
        registered = self.registry.get(message.function)
        if registered is None:
            served = ", ".join(sorted(self.registry)) or "nothing"
            self._reply_error(held, message, ErrorInfo(
                "unknown_function", "LookupError",
                f"function {message.function!r} is not served by the workers of queue "
                f"{self.config.queue!r} (worker {self.consumer} serves: {served}); start the "
                f"workers with --import <the module defining it>, or set remote_name"),
                "unknown_function")
            return None
        if registered.fingerprint != message.fingerprint:
            self._reply_error(held, message, ErrorInfo(
                "fingerprint", "LookupError",
                f"function {message.function!r} on queue {self.config.queue!r} has fingerprint "
                f"{registered.fingerprint} on worker {self.consumer} but {message.fingerprint} on "
                f"the client: they run different code; deploy the same version to both"),
                "fingerprint")
            return None
        return message, registered, data

    async def _run(self, held: _Held, message: TaskMessage, registered: RegisteredFunction,
                   data: dict[Any, Any]) -> None:
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
        self._complete(held, message, data, started, result, error,
                       spent.to_dict() if spent != Usage() else None)

    def _complete(self, held: _Held, message: TaskMessage, data: dict[Any, Any], started: float,
                  result: Any, error: Exception | None,
                  usage: dict[str, int | float] | None = None) -> None:
        """Queue the reply: the result, or the error with this worker's traceback."""
        self.metrics.inc("asyncgraph_worker_task_seconds_sum", time.perf_counter() - started)
        self.metrics.inc("asyncgraph_worker_task_seconds_count")
        if error is not None:
            tb = "".join(traceback.format_exception(error))[-_MAX_TRACEBACK:]
            info = ErrorInfo("error", type(error).__qualname__, str(error)[:_MAX_TRACEBACK], tb)
            self._reply_error(held, message, info, "error", self._dead_letter(
                held, "error", f"{type(error).__qualname__}: {error}\n{tb}", data), usage=usage)
            return
        reply = ReplyMessage(self.config.queue, message.client, message.id, self.consumer, result,
                             usage=usage)
        try:
            packed, signature = encode(reply, self._signer, self.config.limits)
        except (TypeError, WireError) as exc:
            self._reply_error(held, message, ErrorInfo(
                "error", type(exc).__qualname__,
                f"{message.function}.{message.op} returned a value that cannot be sent back: {exc}"),
                "error")
            return
        self._reply(held, message, packed, signature, "ok")

    def _backward_sync(self, registered: RegisteredFunction, message: TaskMessage) -> Any:
        fn = registered.function
        ctx = ctx_from_state(message.payload.get("ctx"), fn)
        grads = grads_from_entries(message.payload.get("g"), "grad_outputs")
        with no_grad():
            return result_entries(fn.backward(ctx, *grads))

    async def _execute(self, registered: RegisteredFunction, message: TaskMessage) -> Any:
        fn = registered.function
        payload = message.payload
        if message.op == "backward":
            if not fn._backward_is_async and not fn.blocking:
                return self._backward_sync(registered, message)
            ctx = ctx_from_state(payload.get("ctx"), fn)
            grads = grads_from_entries(payload.get("g"), "grad_outputs")
            with no_grad():
                if fn._backward_is_async:
                    result = await fn.backward(ctx, *grads)
                else:
                    result = await anyio.to_thread.run_sync(
                        functools.partial(fn.backward, ctx, *grads), limiter=self._threads)
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
        if inspect.iscoroutinefunction(method):
            return await method(*args, **kwargs)
        if fn.blocking:
            return await anyio.to_thread.run_sync(
                functools.partial(method, *args, **kwargs), limiter=self._threads)
        return method(*args, **kwargs)

    def _deadline(self, entry_id: bytes, ttl_ms: int) -> float:
        """The task's deadline on this process's anyio clock (entry ids are Redis time)."""
        try:
            enqueued_ms = int(entry_id.split(b"-", 1)[0])
        except ValueError:
            enqueued_ms = int(self._redis_now_ms())
        remaining_s = (enqueued_ms + ttl_ms - self._redis_now_ms()) / 1000
        return anyio.current_time() + remaining_s

    # -- replies, acknowledgements, dead letters -------------------------------------------
    def _reply(self, held: _Held, message: TaskMessage, packed: bytes, signature: bytes,
               outcome: str, *extra: list[Any]) -> None:
        stream = keys.reply_stream(self.config.queue, message.client)
        self._finish(held, outcome, [
            ["XADD", stream, "*", keys.F_MESSAGE, packed, keys.F_SIGNATURE, signature], *extra,
        ], stream)

    def _reply_error(self, held: _Held, message: TaskMessage, info: ErrorInfo, outcome: str,
                     *extra: list[Any], usage: dict[str, int | float] | None = None) -> None:
        reply = ReplyMessage(self.config.queue, message.client, message.id, self.consumer,
                             error=info, usage=usage)
        packed, signature = encode(reply, self._signer)
        self._reply(held, message, packed, signature, outcome, *extra)

    def _dead_letter(self, held: _Held, reason: str, text: str, data: dict[Any, Any]) -> list[Any]:
        """The XADD that dead-letters ``held`` with its reason and (truncated) original message."""
        self.metrics.inc("asyncgraph_worker_dead_letters_total", reason=reason)
        log.warning("worker %s dead-lettered entry %s (%s): %.300s", self.consumer,
                    held.entry_id.decode(errors="replace"), reason, text)
        fields: list[Any] = [keys.F_REASON, reason, keys.F_ERROR, text[:_MAX_TRACEBACK],
                             keys.F_WORKER, self.consumer, keys.F_TASK, held.entry_id]
        original = data.get(keys.F_MESSAGE)
        if isinstance(original, bytes):
            fields += [keys.F_ORIGINAL, original[:_MAX_ORIGINAL]]
        return ["XADD", self._dead, "MAXLEN", "~", keys.DEAD_MAXLEN, "*", *fields]

    def _finish(self, held: _Held, outcome: str, commands: list[list[Any]] | None = None,
                reply_stream: str | None = None) -> None:
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
            commands += [["XACK", self._tasks, keys.GROUP, *ids], ["XDEL", self._tasks, *ids],
                         ["EXEC"]]
            try:
                with anyio.CancelScope(shield=True):  # bounded by the pool's deadline
                    replies = await self._pool.pipeline(commands)
            except RedisConnectionLost as exc:
                self._redis_failed(f"writing {len(batch)} repl(ies) (will retry)", exc)
                self._outgoing[:0] = batch
                return False
        finally:
            self._flushing -= 1
        if isinstance(replies[-1], ReplyError):
            log.warning("worker %s: reply transaction failed: %s", self.consumer, replies[-1])
        self._last_redis_ok = time.monotonic()
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
                    "XCLAIM", self._tasks, keys.GROUP, self.consumer, 0, *leftover,
                    "IDLE", self.config.lease_ms * 10, "JUSTID")
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
                await self._pool.execute("XCLAIM", self._tasks, keys.GROUP, self.consumer, 0,
                                         *ids, "JUSTID")
            except (RedisConnectionLost, ReplyError) as exc:
                self._redis_failed("renewing leases", exc)

    async def _heartbeat(self) -> None:
        period = min(self.config.lease_ms / 3000, 5.0)
        workers = keys.workers_hash(self.config.queue)
        last_sweep = 0.0
        while True:
            try:
                await self._sync_clock()
                expiry = int(self._redis_now_ms() + 3 * period * 1000 + 1000)
                await self._pool.execute("HSET", workers, self.consumer, expiry)
                now = time.monotonic()
                if now - last_sweep > 30:
                    last_sweep = now
                    beats = await self._pool.execute("HGETALL", workers)
                    stale = [beats[i] for i in range(0, len(beats), 2)
                             if int(beats[i + 1]) < self._redis_now_ms() - 60_000]
                    if stale:
                        await self._pool.execute("HDEL", workers, *stale)
            except (RedisConnectionLost, ReplyError, ValueError) as exc:
                self._redis_failed("heartbeat", exc)
            if self.config.supervisor_pid and os.getppid() != self.config.supervisor_pid:
                log.warning("worker %s: supervisor %d is gone, draining", self.consumer,
                            self.config.supervisor_pid)
                self.drain()
            now = time.monotonic()
            for task_key, until in list(self._cancelled.items()):
                if until < now:
                    del self._cancelled[task_key]
            self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._held))
            if self.config.metrics_dir:
                try:
                    self.metrics.write_snapshot(self.config.metrics_dir)
                except OSError as exc:
                    log.warning("worker %s: writing metrics: %s", self.consumer, exc)
            await anyio.sleep(min(period, 1.0) if self.config.metrics_dir else period)

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
                        reply = await conn.execute("XREAD", "COUNT", 512, "BLOCK", _BLOCK_MS,
                                                   "STREAMS", stream, last_id)
                except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                    self._redis_failed("reading cancellations", exc)
                    if conn is not None:
                        await conn.aclose()
                        conn = None
                    await anyio.sleep(0.5)
                    continue
                if not reply:
                    continue
                for entry_id, fields in reply[0][1]:
                    last_id = entry_id
                    data = dict(zip(fields[::2], fields[1::2], strict=False))
                    try:
                        message = decode(data.get(keys.F_MESSAGE), data.get(keys.F_SIGNATURE),
                                         self._signer, self.config.queue, self.config.limits)
                        if not isinstance(message, CancelMessage):
                            raise WireError("not a cancel message")
                    except WireError as exc:
                        self.metrics.inc("asyncgraph_worker_dead_letters_total", reason="bad_cancel")
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
