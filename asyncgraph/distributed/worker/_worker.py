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
  a slow synchronous function never stalls leases, heartbeats or cancellations; a
  thread cannot be stopped, so a cancelled synchronous call is abandoned: it keeps
  its slot (``abandoned`` in health and status) until it really returns;
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
  for ``2 x lease_ms``, hold nothing and have no live heartbeat.

The pieces, each in its module: ``_admission`` (a pure function: run the entry, or
settle it how), ``_outcomes`` (the commands that settle a task), ``_reply_writer``
(writes them with the acknowledgements), ``_intake`` (reader and reclaimer),
``_membership`` (group, clock, leases, heartbeat, consumers), ``_cancels``,
``_execute`` and ``_runner`` (one task per entry, stopped at its deadline or on a
cancel). ``Worker`` wires them together.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import time
import uuid
from typing import Any

import anyio
import anyio.abc

import asyncgraph
from asyncgraph.distributed.wire._schema import TaskMessage
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._admission import Admitted, Rules, admit
from asyncgraph.distributed.worker._around import AroundTask
from asyncgraph.distributed.worker._cancels import Cancels
from asyncgraph.distributed.worker._config import WorkerConfig
from asyncgraph.distributed.worker._execute import Threads, execute
from asyncgraph.distributed.worker._health import serve_health
from asyncgraph.distributed.worker._intake import Intake
from asyncgraph.distributed.worker._membership import Membership
from asyncgraph.distributed.worker._metrics import worker_metrics
from asyncgraph.distributed.worker._outcomes import Held, Replies, Settled
from asyncgraph.distributed.worker._redis_health import RedisHealth
from asyncgraph.distributed.worker._registry import Registry
from asyncgraph.distributed.worker._reply_writer import ReplyWriter
from asyncgraph.distributed.worker._runner import Runner, open_runner
from asyncgraph.resp import Pool, RedisConnectionLost, ReplyError, parse_redis_url
from asyncgraph.taskhooks import TaskInfo, task_hooks

__all__ = ["Worker", "WorkerConfig"]

log = logging.getLogger("asyncgraph.distributed.worker")

_NO_HOOKS = contextlib.nullcontext()  # around a task when no task hook is installed
_FINISHED_MEMORY = 4096  # entry ids of tasks just settled, not to be re-run if reclaimed late


class Worker:
    """Serves ``registry`` on ``config.queue`` until cancelled or drained (SIGTERM).

    The composition root of the pieces listed in the module docstring: it holds the
    table of held tasks they share, runs one task per admitted entry, and owns the
    lifecycle (connect, serve, drain, leave). About 350 lines of wiring, no protocol
    logic of its own.

    ``await Worker(config, registry).serve()``; ``drain()`` stops taking tasks
    and lets the ones held finish (at most ``drain_timeout_s``).
    """

    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.consumer = config.consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.metrics = worker_metrics()
        signer = Signer(config.secret)
        self._pool = Pool(parse_redis_url(config.redis_url), timeout_s=config.redis_timeout_s)
        self._health = RedisHealth(self.consumer, self.metrics)
        self._held: dict[bytes, Held] = {}
        self._finished: dict[bytes, None] = {}
        self._threads = Threads(config.concurrency)
        self._threads.on_ended = self._released
        self._replies = Replies(config.queue, self.consumer, signer, config.limits, self.metrics)
        self._rules = Rules(
            config.queue, self.consumer, signer, config.limits, registry, config.max_attempts
        )
        self._membership = Membership(
            config,
            self.consumer,
            self._pool,
            self._health,
            self.metrics,
            held=lambda: list(self._held),
            info_json=self._info_json,
        )
        self._cancels = Cancels(
            config,
            self.consumer,
            self._pool,
            signer,
            self._health,
            self.metrics,
            self._membership.redis_now_ms,
            stop=self._stop_task,
        )
        self._writer = ReplyWriter(
            self._pool, config.queue, self._replies, self._health, self.metrics, self._written
        )
        self._intake = Intake(
            config,
            self.consumer,
            self._pool,
            self._health,
            self.metrics,
            self._writer,
            free_slots=self._free_slots,
            held=self._held,
            take=self._take,
            ensure_group=self._membership.ensure_group,
        )
        self._idle: anyio.Event | None = None
        self._intake_scope: anyio.CancelScope | None = None
        self._connecting: anyio.CancelScope | None = None
        self._runner: Runner | None = None
        self._draining = False
        self._drained = False
        self._started_at = time.time()

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
        self._idle = anyio.Event()
        self._intake_scope = anyio.CancelScope()
        self._connecting = anyio.CancelScope()
        if self._draining:
            self._intake_scope.cancel()
            self._connecting.cancel()
        # Policies installed by other layers (asyncgraph.text's model policy: only the
        # allowed base URLs may receive this process's API key), lifted when serving ends.
        settings = {"allowed_base_urls": self.config.allowed_base_urls}
        undo = [hook.serving(settings) for hook in task_hooks().values()]
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
                        await self._membership.connect()
                    except RedisConnectionLost as exc:
                        connect_error = exc
                if not self._membership.connected:  # gave up, or drained before Redis answered
                    task_status.started()
                    services.cancel_scope.cancel()
                else:
                    await self._serve_connected(services, task_status)
        finally:
            for lift in reversed(undo):
                lift()
            if self._membership.connected:
                with anyio.CancelScope(shield=True):
                    await self._membership.leave(self._drained)
            with anyio.CancelScope(shield=True):
                await self._pool.aclose()
        if connect_error is not None:
            raise connect_error
        log.info("worker %s stopped", self.consumer)

    async def _serve_connected(
        self, services: anyio.abc.TaskGroup, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        services.start_soon(self._writer.run)
        services.start_soon(self._cancels.watch)
        services.start_soon(self._membership.lease_renewer)
        services.start_soon(self._heartbeat)
        async with open_runner() as runner:
            self._runner = runner
            assert self._intake_scope is not None
            with self._intake_scope:
                async with anyio.create_task_group() as intake:
                    intake.start_soon(self._intake.reader)
                    intake.start_soon(self._intake.reclaimer)
                    task_status.started()
            log.info("worker %s draining: %d task(s) held", self.consumer, len(self._held))
            with anyio.move_on_after(self.config.drain_timeout_s):
                while self._held:
                    self._idle = anyio.Event()
                    await self._idle.wait()
            self._drained = not self._held
            runner.stop_all()
        if self._writer.pending:  # settled by the cancellation above: write them (bounded)
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.redis_timeout_s):
                await self._writer.flush()
        await self._membership.hand_back([h.entry_id for h in self._held.values()])
        services.cancel_scope.cancel()

    @property
    def abandoned(self) -> int:
        """Synchronous calls cancelled but still running in their threads."""
        return self._threads.abandoned

    def _info_json(self) -> str:
        """What ``asyncgraph status`` shows of this worker (plain JSON, never code)."""
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": self.config.concurrency,
                "in_flight": len(self._held),
                "abandoned": self.abandoned,
                "version": asyncgraph.__version__,
                "draining": self._draining,
                "started": self._started_at,
            }
        )

    def drain(self) -> None:
        """Stop reading tasks; ``serve`` returns once the held ones are done."""
        self._draining = True
        for scope in (self._connecting, self._intake_scope):
            if scope is not None:
                scope.cancel()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: connected, Redis answering lately, not draining (the /readyz answer)."""
        beat_s = self._membership.beat_s
        answering, age = self._health.answering(max(3 * beat_s, 10.0))
        connected = self._membership.connected
        ok = connected and answering and not self._draining
        if self._draining:
            status = "draining"
        elif not connected:
            status = "connecting to Redis"
        else:
            status = "ok" if ok else "redis unreachable"
        return ok, {
            "status": status,
            "consumer": self.consumer,
            "queue": self.config.queue,
            "in_flight": len(self._held),
            "abandoned": self.abandoned,
            "concurrency": self.config.concurrency,
            "redis_ok_age_s": round(age, 3) if self._health.last_ok else None,
            "functions": sorted(self.registry),
        }

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the process and its event loop answer (not tied to Redis: /livez)."""
        return True, {"status": "alive", "consumer": self.consumer}

    # -- tasks -----------------------------------------------------------------------
    def _free_slots(self) -> int:
        return self.config.concurrency - len(self._held) - self.abandoned

    def _take(self, entry_id: bytes, fields: Any, deliveries: int) -> None:
        if entry_id in self._held:
            return
        if entry_id in self._finished:
            # Settled and acknowledged by this worker a moment ago: an XAUTOCLAIM that
            # ran just before that write returned it (after a stall past the lease).
            return
        runner = self._runner
        assert runner is not None
        held = self._held[entry_id] = Held(entry_id, delivery=deliveries)
        decided = admit(
            held,
            fields,
            deliveries,
            self._rules,
            self._replies,
            cancelled=self._cancels,
            deadline_of=self._membership.deadline,
            now=runner.now(),
            client_gone=self._membership.client_gone,
        )
        if isinstance(decided, Settled):
            self._writer.queue(decided)
            return
        assert held.key is not None
        self._cancels.running[held.key] = held
        runner.start(held, self._run, held, decided)

    def _stop_task(self, held: Held, reason: str) -> None:
        if self._runner is not None:
            self._runner.stop(held, reason)

    async def _run(self, held: Held, admitted: Admitted) -> None:
        """Run an async (or threaded) task under its deadline; a cancel message stops it."""
        runner = self._runner
        assert held.key is not None and runner is not None
        if held.stopped is not None:  # cancelled (or expired) before it began
            self._settle(held, self._replies.settled(held, held.stopped))
            return
        message: TaskMessage = admitted.message
        started = time.perf_counter()
        result: Any = None
        error: Exception | None = None
        around: AroundTask | None = None
        hooks = task_hooks()
        if hooks:  # else no TaskInfo to build
            info = TaskInfo(
                message.function,
                message.op,
                self.config.queue,
                self.consumer,
                message.id,
                self._membership.queued_s(held.entry_id),
                held.delivery,
            )
            around = AroundTask(hooks, message.meta or {}, info, self.consumer)
        with around or _NO_HOOKS:
            try:
                result = await execute(admitted.registered, message, self._threads)
            except Exception as exc:
                error = exc
            except runner.cancelled:
                why = runner.why_stopped(held)
                if why is None:
                    raise  # the worker is stopping: the task is handed back
                self._settle(held, self._replies.settled(held, why))
                return
        spent = time.perf_counter() - started
        self.metrics.observe("asyncgraph_worker_task_seconds", spent)
        self.metrics.observe_histogram(
            "asyncgraph_worker_task_duration_seconds",
            spent,
            function=message.function,
            op=message.op,
        )
        meta = around.metadata() if around is not None else None
        self._settle(held, self._replies.result(held, message, admitted.data, result, error, meta))

    def _settle(self, held: Held, settled: Settled) -> None:
        """The task is over: no cancel message can stop it any more; write how it ended."""
        assert held.key is not None
        self._cancels.running.pop(held.key, None)
        self._writer.queue(settled)

    def _written(self, entry_ids: list[bytes]) -> None:
        """``entry_ids`` were settled in Redis: release their slots."""
        for entry_id in entry_ids:
            self._held.pop(entry_id, None)
            self._finished[entry_id] = None
        while len(self._finished) > _FINISHED_MEMORY:
            del self._finished[next(iter(self._finished))]
        self._released()

    def _released(self) -> None:
        self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._held))
        self.metrics.set("asyncgraph_worker_abandoned_calls", self.abandoned)
        self._intake.released()
        if not self._held and self._idle is not None:
            self._idle.set()

    # -- background --------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        every_s = self._membership.housekeeping_every_s()
        last_housekeeping = time.monotonic()
        while True:
            try:
                await self._membership.beat()
                if time.monotonic() - last_housekeeping >= every_s:
                    last_housekeeping = time.monotonic()
                    await self._membership.housekeeping()
            except (RedisConnectionLost, ReplyError, ValueError, TimeoutError) as exc:
                self._health.failed("heartbeat", exc)
            if self._membership.supervisor_gone():
                log.warning(
                    "worker %s: supervisor %d is gone, draining",
                    self.consumer,
                    self.config.supervisor_pid,
                )
                self.drain()
            self._cancels.forget_old()
            self._released()
            await anyio.sleep(self._membership.beat_s)

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

    async def _signal_watcher(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._draining:
                    log.warning("worker %s: second signal, stopping now", self.consumer)
                    if self._runner is not None:
                        self._runner.stop_all()
                    return
                log.info("worker %s: %s, draining", self.consumer, signal.Signals(signum).name)
                self.drain()
