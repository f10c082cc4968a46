"""One task per entry read: admit it, run it under its deadline, settle it.

The thin shell around two pure parts: ``admit`` decides whether an entry runs (or how
it is settled at once), ``Replies`` builds what settles it; ``execute`` runs the
Function, the runner (``ctx.slots.runner``) gives each task its own task, and the
``ReplyWriter`` writes the outcome.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from asyncgraph.distributed.wire._keys import calls_key
from asyncgraph.distributed.wire._schema import TaskMessage
from asyncgraph.distributed.worker._admission import Admitted, Rules, admit
from asyncgraph.distributed.worker._around import AroundTask
from asyncgraph.distributed.worker._cancels import Cancels
from asyncgraph.distributed.worker._context import WorkerContext
from asyncgraph.distributed.worker._execute import execute
from asyncgraph.distributed.worker._membership import Membership
from asyncgraph.distributed.worker._outcomes import Held, Settled
from asyncgraph.distributed.worker._registry import Registry
from asyncgraph.distributed.worker._reply_writer import ReplyWriter
from asyncgraph.taskhooks import TaskInfo, task_hooks

__all__ = ["Tasks"]

_NO_HOOKS = contextlib.nullcontext()  # around a task when no task hook is installed


class Tasks:
    """Takes the entries the intake reads: ``take(entry_id, fields, deliveries)`` each one."""

    def __init__(
        self,
        ctx: WorkerContext,
        registry: Registry,
        writer: ReplyWriter,
        cancels: Cancels,
        membership: Membership,
    ) -> None:
        config = ctx.config
        self._ctx = ctx
        self._slots = ctx.slots
        self._writer = writer
        self._replies = writer.replies
        self._cancels = cancels
        self._membership = membership
        self._rules = Rules(
            config.queue, ctx.consumer, ctx.signer, config.limits, registry, config.max_attempts
        )

    def take(
        self,
        entry_id: bytes,
        fields: Any,
        deliveries: int,
        client_gone: Callable[[str], bool] = lambda client: False,
    ) -> None:
        """Run the entry's task, or settle it at once; nothing if it is held or just settled.

        ``client_gone``: whether a client died, as the intake found for this batch.
        """
        held = self._slots.hold(entry_id, deliveries)
        if held is None:
            return
        runner = self._slots.runner
        assert runner is not None
        decided = admit(
            held,
            fields,
            deliveries,
            self._rules,
            self._replies,
            cancelled=self._cancels,
            deadline_of=self._membership.deadline,
            now=runner.now(),
            client_gone=client_gone,
        )
        if isinstance(decided, Settled):
            self._writer.queue(decided)
            return
        assert held.key is not None
        self._slots.running[held.key] = held
        runner.start(held, self._run, held, decided)

    async def _run(self, held: Held, admitted: Admitted) -> None:
        """Run an async (or threaded) task under its deadline; a cancel message stops it."""
        runner = self._slots.runner
        assert held.key is not None and runner is not None
        if held.stopped is not None:  # cancelled (or expired) before it began
            self._settle(held, self._replies.settled(held, held.stopped))
            return
        message: TaskMessage = admitted.message
        ctx = self._ctx
        started = time.perf_counter()
        result: Any = None
        error: Exception | None = None
        around: AroundTask | None = None
        hooks = task_hooks()
        if hooks:  # else no TaskInfo to build
            info = TaskInfo(
                message.function,
                message.op,
                ctx.config.queue,
                ctx.consumer,
                message.id,
                self._membership.queued_s(held.entry_id),
                held.delivery,
                calls_key(ctx.config.queue, message.client, message.id),
                message.ttl_ms / 1000,
            )
            around = AroundTask(hooks, message.meta or {}, info, ctx.consumer)
        with around or _NO_HOOKS:
            try:
                result = await execute(admitted.registered, message, self._slots.threads)
            except Exception as exc:
                error = exc
            except runner.cancelled:
                why = runner.why_stopped(held)
                if why is None:
                    raise  # the worker is stopping: the task is handed back
                self._settle(held, self._replies.settled(held, why))
                return
        spent = time.perf_counter() - started
        ctx.metrics.observe("asyncgraph_worker_task_seconds", spent)
        ctx.metrics.observe_histogram(
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
        self._slots.running.pop(held.key, None)
        self._writer.queue(settled)
