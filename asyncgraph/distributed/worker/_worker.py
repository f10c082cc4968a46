"""The worker loop: serve remote backwards (and forwards) from one Redis queue.

Delivery is at-least-once with idempotent completion:

- the worker connects to Redis with backoff until it answers (at most
  ``connect_timeout_s`` when set), serving its health endpoint meanwhile;
- tasks are read in batches with XREADGROUP, never more than ``concurrency``
  held at once, and fewer when recent entries were big (a read buffers at most
  about ``_intake.READ_BUDGET`` bytes); a bulk string above ``max_message_bytes`` (plus a
  small margin) is skipped unread and its entry dead-lettered as "oversize";
- every task runs in its own task: async backwards and forwards on the event
  loop, synchronous ones in a worker thread (at most ``concurrency`` threads), so
  a slow synchronous function never stalls leases, heartbeats or cancellations; a
  thread cannot be stopped, so a cancelled synchronous call is abandoned (see NOTE
  [Abandoned calls]);
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

NOTE [Abandoned calls]: a synchronous call cancelled while it runs (its deadline
passed, its client cancelled it, a drain timed out) runs on in its thread until it
returns: Python cannot stop a thread. It is counted (``abandoned`` in health, status
and the ``asyncgraph_worker_abandoned_calls`` gauge) but takes no slot, so a worker
whose every slot ran into a hung call still serves the next tasks at once. Abandoned
calls are bounded instead: one beyond ``max_abandoned`` (default: the concurrency)
and the worker drains and exits with ``EXIT_REPLACE`` (75), the only way to free
those threads, so that its supervisor (``--processes``) or orchestrator replaces it.

The pieces, each in its module: ``_admission`` (a pure function: run the entry, or
settle it how), ``_outcomes`` (the commands that settle a task), ``_reply_writer``
(writes them with the acknowledgements), ``_intake`` (reader and reclaimer),
``_membership`` (group, clock, leases, heartbeat, consumers), ``_cancels``, ``_tasks``,
``_execute`` and ``_runner`` (one task per entry, stopped at its deadline or on a
cancel), ``_slots`` (the tasks held: the state the others read) and ``_context``
(what they all share). ``Worker`` makes the context and wires them together.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from typing import Any

import anyio
import anyio.abc

from asyncgraph._exceptions import ConfigError
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.worker._cancels import Cancels
from asyncgraph.distributed.worker._config import WorkerConfig
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.distributed.worker._health import serve_health
from asyncgraph.distributed.worker._intake import Intake
from asyncgraph.distributed.worker._membership import Membership
from asyncgraph.distributed.worker._outcomes import Replies
from asyncgraph.distributed.worker._registry import Registry
from asyncgraph.distributed.worker._reply_writer import ReplyWriter
from asyncgraph.distributed.worker._tasks import Tasks
from asyncgraph.resp import RedisConnectionLost, ReplyError
from asyncgraph.taskhooks import task_hooks

__all__ = ["EXIT_REPLACE", "Worker", "WorkerConfig"]

log = logging.getLogger("asyncgraph.distributed.worker")

EXIT_REPLACE = 75  # EX_TEMPFAIL: drained because of abandoned calls; start a fresh process


class Worker:
    """Serves ``registry`` on ``config.queue`` until cancelled or drained (SIGTERM).

    The composition root of the pieces listed in the module docstring: it makes the
    context they share (``WorkerContext``: settings, pool, health, metrics, the slots of
    the tasks held), hands it to each, and owns the lifecycle (connect, serve, drain,
    leave). Wiring only, no protocol logic of its own.

    ``await Worker(config, registry).serve()``; ``drain()`` stops taking tasks
    and lets the ones held finish (at most ``drain_timeout_s``). ``needs_replacing``
    after ``serve`` returns: it drained because of too many abandoned calls (NOTE
    [Abandoned calls]); ``asyncgraph worker`` then exits with ``EXIT_REPLACE``.

    Example::

        config = WorkerConfig(redis_url="redis://127.0.0.1:6379/0", queue="grads")
        worker = Worker(config, build_registry(["myfunctions"]))
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)      # returns once it serves
            ...
            worker.drain()                    # stop taking tasks; serve returns when done
    """

    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        ctx = self._ctx = WorkerContext.new(config, too_many_abandoned=self._too_many_abandoned)
        self.consumer = ctx.consumer
        self.metrics = ctx.metrics
        replies = Replies(config.queue, ctx.consumer, ctx.signer, config.limits, ctx.metrics)
        self._membership = Membership(ctx)
        self._cancels = Cancels(ctx)
        self._writer = ReplyWriter(ctx, replies)
        self._tasks = Tasks(ctx, registry, self._writer, self._cancels, self._membership)
        self._intake = Intake(ctx, self._writer, self._tasks)
        self._drained = False
        self.needs_replacing = False  # drained for too many abandoned calls: exit EXIT_REPLACE

    # -- lifecycle -----------------------------------------------------------------
    async def serve(
        self,
        *,
        handle_signals: bool = False,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled or drained; ``task_status.started()`` once connected.

        Raises ``RedisConnectionLost`` if Redis did not answer within
        ``connect_timeout_s`` (when set), and ``ConfigError`` when an installed task hook
        cannot work with this Redis user (the models hook: the call journal cannot be
        written and read back, e.g. the ACL grants too little), before any task is taken.
        """
        # Policies installed by other layers (asyncgraph.text's model policy: only the
        # allowed base URLs may receive this process's API key), lifted when serving ends.
        settings = {
            "allowed_base_urls": self.config.allowed_base_urls,
            "redis_url": self.config.redis_url,  # for the journal of a task's model calls
            "redis_timeout_s": self.config.redis_timeout_s,
            # Every record read back from Redis is sealed and verified with the fleet's
            # secret (NOTE [Sealed records]); one that fails is ignored, and counted here.
            "record_seal": self._ctx.signer,
            "on_ignored_record": self._count_ignored_record,
            "journal_probe_key": keys.calls_key(
                self.config.queue, keys.PROBE_CLIENT, f"probe:{self.consumer}"
            ),
        }
        undo = [hook.serving(settings) for hook in task_hooks().values()]
        connect_error: RedisConnectionLost | ConfigError | None = None
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
                with self._ctx.stopping.scope():
                    try:
                        await self._membership.connect()
                        await self._probe_hooks()
                    except (RedisConnectionLost, ConfigError) as exc:
                        connect_error = exc
                if connect_error is not None or not self._membership.connected:
                    # gave up, a hook cannot work here, or drained before Redis answered
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
                await self._ctx.pool.aclose()
        if connect_error is not None:
            raise connect_error
        log.info("worker %s stopped", self.consumer)

    async def _serve_connected(
        self, services: anyio.abc.TaskGroup, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        slots = self._ctx.slots
        services.start_soon(self._writer.run)
        services.start_soon(self._cancels.watch, self._membership.redis_now_ms())
        services.start_soon(self._membership.lease_renewer)
        services.start_soon(self._heartbeat)
        async with slots.runner.serving():
            with self._ctx.stopping.scope():
                async with anyio.create_task_group() as intake:
                    intake.start_soon(self._intake.reader)
                    intake.start_soon(self._intake.reclaimer)
                    task_status.started()
            log.info("worker %s draining: %d task(s) held", self.consumer, len(slots.held))
            with anyio.move_on_after(self.config.drain_timeout_s):
                await slots.wait_idle()
            self._drained = not slots.held
            slots.runner.stop_all()
        if self._writer.pending:  # settled by the cancellation above: write them (bounded)
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.config.redis_timeout_s):
                await self._writer.flush()
        await self._membership.hand_back([h.entry_id for h in slots.held.values()])
        services.cancel_scope.cancel()

    @property
    def abandoned(self) -> int:
        """Synchronous calls cancelled but still running in their threads."""
        return self._ctx.slots.abandoned

    def _too_many_abandoned(self) -> None:
        """See NOTE [Abandoned calls]."""
        if self._ctx.stopping.draining:
            return
        slots = self._ctx.slots
        log.warning(
            "worker %s: %d synchronous call(s) abandoned in their threads, above "
            "max_abandoned=%d: draining, to be replaced by a fresh process",
            self.consumer,
            slots.abandoned,
            slots.max_abandoned,
        )
        self.needs_replacing = True
        self.drain()

    def drain(self) -> None:
        """Stop reading tasks; ``serve`` returns once the held ones are done."""
        self._ctx.stopping.drain()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: connected, Redis answering lately, not draining (the /readyz answer)."""
        beat_s = self._membership.beat_s
        answering, age = self._ctx.health.answering(max(3 * beat_s, 10.0))
        connected = self._membership.connected
        draining = self._ctx.stopping.draining
        ok = connected and answering and not draining
        if draining:
            status = "draining: too many abandoned calls" if self.needs_replacing else "draining"
        elif not connected:
            status = "connecting to Redis"
        else:
            status = "ok" if ok else "redis unreachable"
        return ok, {
            "status": status,
            "consumer": self.consumer,
            "queue": self.config.queue,
            "in_flight": len(self._ctx.slots.held),
            "abandoned": self.abandoned,
            "concurrency": self.config.concurrency,
            "redis_ok_age_s": round(age, 3) if self._ctx.health.last_ok else None,
            "functions": sorted(self.registry),
        }

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the process and its event loop answer (not tied to Redis: /livez)."""
        return True, {"status": "alive", "consumer": self.consumer}

    async def _probe_hooks(self) -> None:
        """Each task hook's optional ``probe()``: what it needs from Redis, checked once
        before the first task (a journal the ACL does not allow fails the start, not each
        call)."""
        for hook in task_hooks().values():
            probe = getattr(hook, "probe", None)
            if probe is not None:
                await probe()

    def _count_ignored_record(self, record: str) -> None:
        self.metrics.inc("asyncgraph_worker_ignored_records_total", record=record)

    # -- background --------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        # See NOTE [Consumer sweep] (_membership): at start, once more when the consumers
        # too young for the first sweep can go, then every housekeeping_every_s().
        periods = self._membership.housekeeping_periods()
        next_housekeeping = time.monotonic()
        while True:
            try:
                await self._membership.beat()
                if time.monotonic() >= next_housekeeping:
                    next_housekeeping = time.monotonic() + next(periods)
                    await self._membership.housekeeping()
            except (RedisConnectionLost, ReplyError, ValueError, TimeoutError) as exc:
                self._ctx.health.failed("heartbeat", exc)
            if self._membership.supervisor_gone():
                log.warning(
                    "worker %s: supervisor %d is gone, draining",
                    self.consumer,
                    self.config.supervisor_pid,
                )
                self.drain()
            self._cancels.forget_old()
            self._ctx.slots.changed()
            await anyio.sleep(self._membership.beat_s)

    async def _reporter(self) -> None:
        """Under a supervisor: write metrics and health to its directory every second."""
        assert self.config.metrics_dir is not None
        while True:
            self.metrics.set("asyncgraph_worker_tasks_in_flight", len(self._ctx.slots.held))
            try:
                self.metrics.write_snapshot(self.config.metrics_dir, health=self.health())
            except OSError as exc:
                log.warning("worker %s: writing metrics: %s", self.consumer, exc)
            await anyio.sleep(1.0)

    async def _signal_watcher(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._ctx.stopping.draining:
                    log.warning("worker %s: second signal, stopping now", self.consumer)
                    self._ctx.slots.runner.stop_all()
                    return
                log.info("worker %s: %s, draining", self.consumer, signal.Signals(signum).name)
                self.drain()
