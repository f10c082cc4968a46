"""One task per entry read: admit it, run it under its deadline, settle it.

The thin shell around two pure parts: ``admit`` decides whether an entry runs (or how
it is settled at once), ``Replies`` builds what settles it; ``execute`` runs the
Function, the runner (``ctx.slots.runner``) gives each task its own task, and the
``ReplyWriter`` writes the outcome.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from asyncgraph.distributed.wire._keys import calls_key, reply_ttl_s
from asyncgraph.distributed.wire._schema import TaskMessage
from asyncgraph.distributed.worker._admission import (
    Admitted,
    Rules,
    admit,
    claim_commands,
    claimed,
    expiry,
    held_by,
    memory_refused,
    replayed,
    unverified_claim,
)
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

log = logging.getLogger("asyncgraph.distributed.worker")

_NO_HOOKS = contextlib.nullcontext()  # around a task when no task hook is installed


class Tasks:
    """Takes the entries the intake reads: ``admit`` each, then ``start`` the admitted ones
    with the replies to their ``claims`` (one round trip per batch: NOTE [Replays])."""

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

    def admit(
        self,
        entry_id: bytes,
        fields: Any,
        deliveries: int,
        client_gone: Callable[[str], bool] = lambda client: False,
    ) -> tuple[Held, Admitted] | None:
        """Hold and admit the entry's task, or settle it at once (None; None too if it is
        held already or was just settled). An admitted task waits for ``start``.

        ``client_gone``: whether a client died, as the intake found for this batch.
        """
        held = self._slots.hold(entry_id, deliveries)
        if held is None:
            return None
        decided = admit(
            held,
            fields,
            deliveries,
            self._rules,
            self._replies,
            cancelled=self._cancels,
            now=anyio.current_time(),
            redis_now_ms=self._membership.redis_now_ms(),
            client_gone=client_gone,
        )
        if isinstance(decided, Settled):
            self._writer.queue(decided)
            return None
        return held, decided

    def claims(self, admitted: list[tuple[Held, Admitted]]) -> list[list[Any]]:
        """The commands that claim ``admitted`` in the replay memory (NOTE [Replays]): two per
        task, in order, then the claims keys' expiries."""
        signer = self._rules.signer
        commands = [c for held, a in admitted for c in claim_commands(held, a.memory, signer)]
        return commands + expiry((a.memory for _, a in admitted), lambda m: m.claims)

    def start(self, held: Held, admitted: Admitted, set_reply: Any, bit_reply: Any) -> bool:
        """Run an admitted task, given the replies to its two ``claims`` commands, or settle it
        unrun (``claimed``: answered already, or Redis refused the claim; or it was cancelled
        meanwhile). True when another claim holds it: read that claim and ``start_held``."""
        decision = claimed(set_reply, bit_reply)
        if decision == "held":
            return True
        if decision == "refused":
            error = set_reply if isinstance(set_reply, Exception) else bit_reply
            settled = memory_refused(held, admitted, error, self._replies, release=set_reply == 1)
            self._writer.queue(settled)
        elif decision == "answered":
            why = "was answered already"
            self._writer.queue(replayed(held, admitted, why, self._replies, release=set_reply == 1))
        else:
            self._run_claimed(held, admitted)
        return False

    def start_held(self, held: Held, admitted: Admitted, stored: Any) -> None:
        """Run a task whose claim (``stored``, read back) is this entry's own; else settle it
        as a replay: another entry runs it, or the claim does not verify (reported, and its
        client answered with an error naming the claim, not left to its timeout)."""
        mine = held_by(held, admitted.memory, self._rules.signer, stored)
        if mine:
            self._run_claimed(held, admitted)
            return
        if mine is None:
            self._ctx.metrics.inc("asyncgraph_worker_ignored_records_total", record="replay")
            log.warning(
                "worker %s: the replay memory's claim of task %s of client %s does not verify "
                "(forged, or written with another secret): ignored; the task is not run, "
                "its client is told",
                self._ctx.consumer,
                admitted.message.id,
                admitted.message.client,
            )
            self._writer.queue(unverified_claim(held, admitted, self._replies))
            return
        why = "is run by another entry (or was, and settled meanwhile)"
        self._writer.queue(replayed(held, admitted, why, self._replies, release=False))

    def hand_back(self, admitted: list[tuple[Held, Admitted]]) -> None:
        """Give up tasks whose claims' round trip was lost, unrun and unacknowledged: they stay
        pending, and their reclaim (after the lease) finds their own claim, or none."""
        for held, _ in admitted:
            self._slots.drop(held.entry_id)

    def _run_claimed(self, held: Held, admitted: Admitted) -> None:
        assert held.key is not None
        if held.key in self._cancels:  # cancelled during the claim's round trip
            self._settle(held, admitted, self._replies.stopped(held, "cancelled"))
            return
        self._slots.running[held.key] = held
        self._slots.runner.start(held, self._run, held, admitted)

    async def _run(self, held: Held, admitted: Admitted) -> None:
        """Run an async (or threaded) task under its deadline; a cancel message stops it."""
        if held.stopped is not None:  # cancelled (or expired) before it began
            self._settle(held, admitted, self._replies.stopped(held, held.stopped))
            return
        message: TaskMessage = admitted.message
        ctx = self._ctx
        started = time.perf_counter()
        result: Any = None
        error: Exception | None = None
        around: AroundTask | None = None
        stopped: str | None = None
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
            except anyio.get_cancelled_exc_class():  # looked up only when something is raised
                stopped = self._slots.runner.why_stopped(held)
                if stopped is None:
                    raise  # the worker is stopping: the task is handed back
        if stopped is not None:  # its hooks report what it spent (a cancel's reply carries it)
            meta = around.metadata() if around is not None else None
            self._settle(held, admitted, self._replies.stopped(held, stopped, meta))
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
        settled = self._replies.result(held, message, admitted.data, result, error, meta)
        settled.answered = True
        settled.reply_ttl_s = reply_ttl_s(message.ttl_ms)
        self._settle(held, admitted, settled)

    def _settle(self, held: Held, admitted: Admitted, settled: Settled) -> None:
        """The task is over: no cancel message can stop it any more; write how it ended, and
        release its claim in the replay memory with it (marked if ``settled.answered``)."""
        assert held.key is not None
        self._slots.running.pop(held.key, None)
        settled.memory = admitted.memory
        self._writer.queue(settled)
