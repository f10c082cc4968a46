"""The task channel: a client's tasks to the worker fleet and their replies, through Redis.

The transport under ``RedisExecutor`` (keys in ``asyncgraph.distributed.wire._keys``,
messages in ``asyncgraph.distributed.wire._schema``). One channel owns, in its
executor's task group:

- a *flusher*: remote nodes made ready together are XADDed to the task stream
  in one pipelined round trip. The engine submits a ready level's remote nodes (``submit``,
  no task waiting for each: NOTE [Submitted nodes] in the engine) and then asks for them to
  leave (``send_submitted``; 256 at most at a time); a remote forward, or a node of an
  engine that runs it in a task, says through ``send_and_wait``'s ``more_coming`` probe
  whether more submissions are on their way. The batch leaves at once, from the
  submitting task, unless other waiters woken with it have yet to resume (their next
  nodes join the batch) or a flush is already on its way. Then the flusher sends
  what gathered once submissions stop arriving for two event-loop checkpoints (or 1,024
  are waiting); cancellations ride along;
- a *listener*: one blocking XREAD on this client's reply stream that resolves
  the waiting tasks; a reply for a task already resolved (a task that ran
  twice) is ignored, so every task is joined exactly once; a reply it cannot
  accept (forged, malformed, too big) fails its task at once when the task id
  can be read;
- a *deadline watcher*: a task gets its reply within ``timeout_s`` or is woken
  ``timed_out`` (its caller diagnoses, then cancels it on the workers);
- *reports of cancelled tasks*: a task whose caller is cancelled is cancelled on the
  workers, and its caller waits (shielded, ``redis_timeout_s`` at most) for what the
  worker that held it reports (its reply to the cancel: the model usage of its calls
  before the cancel, NOTE [One meter] in ``asyncgraph.models``), handed to ``on_report``
  in the caller's context; a task no worker held (still queued: the cancel deletes it)
  reports nothing, and is not waited for;
- a *heartbeat*: while the channel is open, its key (``client_key``) expires
  ``CLIENT_TTL_MS`` ahead and its reply stream ``timeout_s`` ahead (``keys.reply_ttl_s``:
  a reply outlives any stall of this client shorter than its deadline), renewed every
  ``CLIENT_BEAT_MS``, and the beat reads Redis's clock (a task's signed expiry is counted
  on it); workers skip the tasks of a client whose key is gone (it died: nobody would
  read the reply; NOTE [Client liveness] in ``_liveness``). A beat that finds the key
  gone (this loop, or its connection, stalled that long) sends again the tasks in flight
  that workers settled without a reply it can read (skipped, or expired); a task that
  ran meanwhile is not sent again: its reply waits in the reply stream.

Every wait has a deadline: a Redis that is unreachable or goes away fails the
waiting tasks with ``RemoteConnectionError`` within ``redis_timeout_s``.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from asyncgraph import RemoteConnectionError, RemoteError, WireError
from asyncgraph.distributed import _diagnosis as diagnosis
from asyncgraph.distributed._liveness import redis_time_ms
from asyncgraph.distributed._yield import let_ready_tasks_run
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import Limits
from asyncgraph.distributed.wire._schema import (
    CancelMessage,
    ReplyMessage,
    decode,
    encode,
    peek_ids,
)
from asyncgraph.distributed.wire._signing import SECRET_ENV, Signer
from asyncgraph.resp import Connection, Oversize, Pool, RedisConnectionLost, ReplyError

__all__ = ["RedisExecutorStats", "TaskChannel"]


class _NoEvent:
    """The event of a submitted task: nobody waits on it (its ``done`` is told)."""

    def set(self) -> None:
        pass


_NO_EVENT: Any = _NoEvent()

log = logging.getLogger("asyncgraph.distributed")

_READ_COUNT = 1024
_BLOCK_MS = 2000
# Dead letters read by a timeout diagnosis are read without their original messages (up
# to 64 KiB each): bulks above this are skipped unread; error texts (at most 32 KiB) are read.
_DIAGNOSIS_MAX_BULK = 40_000
_SETTLE_CHECKPOINTS = 2  # quiet checkpoints before the flusher sends what was submitted
_IDLE_READ_DELAY_S = 0.05  # an idle listener's next read waits this long for a submission
_MAX_BATCH = 1024  # tasks per round trip at most: a wider level starts going out sooner
_LAPSE_RECHECKS = 3  # beats after a lapse that look again for tasks skipped meanwhile


@dataclass(eq=False, slots=True)
class _Pending:
    task_id: str
    function: str
    event: anyio.Event
    packed: bytes
    signature: bytes
    deadline: float
    entry_id: bytes | None = None
    reply: ReplyMessage | None = None
    error: BaseException | None = None
    cancelled: bool = False
    sent: bool = False
    timed_out: bool = False
    woken: bool = False  # its waiter was woken and has not resumed yet
    reported: anyio.Event | None = (
        None  # cancelled: set once its worker's report came, or none will
    )
    done: Any = None  # submitted without a waiter: ``done.put(self)`` when it is over
    node: Any = None  # the node a submitted task runs the backward of


@dataclass(slots=True)
class RedisExecutorStats:
    """Counters of one executor (for tests, logs and dashboards)."""

    submitted: int = 0
    completed: int = 0
    duplicate_replies: int = 0
    rejected_replies: int = 0
    cancelled: int = 0
    flushes: int = 0
    reconnects: int = 0
    resent: int = 0  # tasks sent again after this client's heartbeat lapsed


class TaskChannel:
    """Sends tasks, waits for their replies, cancels, diagnoses: one client id on one queue.

    The flusher, the listener and the deadline watcher share the one table of tasks in
    flight (``_pending``), and every path (reply, failure, timeout, cancel) removes a task
    from it exactly once.
    """

    def __init__(
        self,
        pool: Pool,
        queue: str,
        *,
        signer: Signer,
        timeout_s: float,
        limits: Limits,
        run_id: bytes | None,
        on_report: Callable[[dict[str, Any]], None] = lambda meta: None,
        on_timeout: Callable[[_Pending], None],
    ) -> None:
        self.queue = queue
        self.client_id = uuid.uuid4().hex
        self.timeout_s = timeout_s
        self.stats = RedisExecutorStats()
        self.closed = False
        self._pool = pool
        self._signer = signer
        self._limits = limits
        self._run_id = run_id
        self._task_stream = keys.task_stream(queue)
        self._reply_stream = keys.reply_stream(queue, self.client_id)
        self._client_key = keys.client_key(queue, self.client_id)
        self._max_bulk = limits.max_message_bytes + keys.BULK_MARGIN
        # Kept as long as this client may wait for a reply in it (as each reply keeps it).
        self._reply_ttl_s = keys.reply_ttl_s(max(1, int(timeout_s * 1000)))
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._reporting: dict[str, _Pending] = {}  # cancelled, waiting for their workers' reports
        self.on_report = on_report
        """Takes the metadata a cancelled task's worker reported, in its caller's context."""
        self.on_timeout = on_timeout
        """Told of a submitted task that timed out (its executor diagnoses it, then puts it
        to its ``done``)."""
        self._outbox: list[_Pending] = []
        self._cancels: list[_Pending] = []
        self._flush_wanted = anyio.Event()
        self._submitted = anyio.Event()
        self._waking = 0  # waiters woken (replies, failures) that have not resumed yet
        self._flushing = 0  # flushes on their way to Redis
        self._clock_offset_ms = 0.0  # Redis's TIME minus this host's clock (``beat``)

    def next_task_id(self) -> str:
        return f"{next(self._ids):x}"

    async def send_and_wait(
        self,
        task_id: str,
        function: str,
        packed: bytes,
        signature: bytes,
        more_coming: Callable[[], bool],
    ) -> _Pending:
        """Send one task (batched with others) and wait until it is answered, failed or timed out.

        ``more_coming``: the engine's probe for the node this task runs (the
        ``run_backward_batched`` protocol; always False outside a pass). Cancelled
        meanwhile, the task is cancelled on the workers too.
        """
        pending = _Pending(
            task_id,
            function,
            anyio.Event(),
            packed,
            signature,
            anyio.current_time() + self.timeout_s,
        )
        self._pending[task_id] = pending
        self._outbox.append(pending)
        self.stats.submitted += 1
        # No cancel scope per node: the deadline watcher expires waits in submission order.
        self._submitted.set()
        try:
            if more_coming() or self._waking or self._flushing:
                # More submissions are on their way: nodes of the same ready level, or
                # the next nodes of other waiters woken with this one (they resume in
                # this tick), or a flush is already out. The flusher sends them together.
                self._flush_wanted.set()
            else:
                # The last of its batch: send the batch now, from this task (one loop
                # iteration sooner than waking the flusher).
                await self._flush(inline=True)
            try:
                await pending.event.wait()
            finally:
                if pending.woken:
                    pending.woken = False
                    self._waking -= 1
        except BaseException:
            self._cancel(pending)
            await self._collect_reports([pending])
            raise
        self.completed(pending)
        return pending

    def submit(
        self, task_id: str, function: str, packed: bytes, signature: bytes, done: Any
    ) -> _Pending:
        """Queue one task with no task waiting for it: ``done.put(pending)`` once it is
        answered, failed or timed out; ``send_submitted`` sends what was queued."""
        pending = _Pending(
            task_id,
            function,
            _NO_EVENT,
            packed,
            signature,
            anyio.current_time() + self.timeout_s,
            done=done,
        )
        self._pending[task_id] = pending
        self._outbox.append(pending)
        self.stats.submitted += 1
        self._submitted.set()
        return pending

    async def send_submitted(self) -> None:
        """Send the queued tasks now, unless a flush is on its way or woken waiters may
        add to the batch (then the flusher sends them together)."""
        if self._waking or self._flushing:
            self._flush_wanted.set()
        else:
            await self._flush(inline=True)

    def completed(self, pending: _Pending) -> None:
        """Count a task whose wait is over as completed, if a reply ended it."""
        if pending.reply is not None:
            self.stats.completed += 1

    async def abandon(self, pendings: list[_Pending]) -> None:
        """Stop waiting for submitted tasks (their pass ended first): cancel those not over
        on the workers, and hand what their workers report to ``on_report``."""
        for pending in pendings:
            self._cancel(pending)
        await self._collect_reports(pendings)

    async def _collect_reports(self, pendings: list[_Pending]) -> None:
        """For tasks their callers stopped waiting for: wait (shielded, ``redis_timeout_s``
        at most in all) for what the workers that held them report, and hand its metadata
        (the model usage of the tasks' calls) to ``on_report``; also when the reply came
        just before."""
        waiting = [p for p in pendings if p.reported is not None]
        if waiting:
            with anyio.move_on_after(self._pool.timeout_s, shield=True):
                for pending in waiting:
                    await pending.reported.wait()  # type: ignore[union-attr]
            for pending in waiting:
                self._reporting.pop(pending.task_id, None)
        for pending in pendings:
            reply = pending.reply
            if reply is not None and reply.meta:
                try:
                    self.on_report(reply.meta)
                except Exception:  # what a worker reported must not change how the caller ends
                    log.exception(
                        "queue %r: the report of cancelled task %s", self.queue, pending.task_id
                    )

    def _reported(self, pending: _Pending) -> None:
        """No (more) report to wait for from ``pending``'s worker."""
        self._reporting.pop(pending.task_id, None)
        if pending.reported is not None:
            pending.reported.set()

    async def beat(self) -> bool:
        """Renew this client's key and its reply stream's expiry; False if the key had expired.

        Raises ``RedisConnectionLost`` or ``ReplyError`` when Redis does not take it.
        """
        before = time.time()
        was, _, now = await self._pool.pipeline(
            [
                ["SET", self._client_key, b"1", "PX", keys.CLIENT_TTL_MS, "GET"],
                ["EXPIRE", self._reply_stream, self._reply_ttl_s],
                ["TIME"],
            ],
            timeout_s=min(self._pool.timeout_s, keys.CLIENT_TTL_MS / 1000),
        )
        if isinstance(was, ReplyError):
            raise was
        if isinstance(now, list):
            self._clock_offset_ms = redis_time_ms(now) - (before + time.time()) * 500
        return was is not None

    def redis_now_ms(self) -> float:
        """The Redis server's clock (``TIME``), in ms, as of this client's last ``beat``: what a
        task's signed expiry is counted on (this host's clock before the first beat)."""
        return time.time() * 1000 + self._clock_offset_ms

    async def heartbeat(self) -> None:
        """Tell the workers this client is alive, while the channel is open (after a first ``beat``).

        A beat that finds the key gone means workers may have skipped this client's
        tasks meanwhile (``_send_lost_again``), and may still skip a few for a moment
        after it is renewed (a worker that asked just before): the next
        ``_LAPSE_RECHECKS`` beats look again.
        """
        rechecks = 0
        failed = False  # a beat since the last good one failed: the key may have lapsed
        due = anyio.current_time()
        while True:
            # Due every CLIENT_BEAT_MS from the last beat's start, not from its reply: on a
            # loaded host the reply's round trip, and the pass of the event loop that
            # resumes this task, would add to the gap between two renewals of the key,
            # which must stay under CLIENT_TTL_MS (a beat overdue goes at once).
            due = max(due + keys.CLIENT_BEAT_MS / 1000, anyio.current_time())
            await anyio.sleep_until(due)
            try:
                # After a failed beat, a good one is a lapse even when it finds the key:
                # the failed beat's bytes may reach Redis when the network comes back and
                # renew the key, hiding that workers skipped tasks meanwhile.
                if not await self.beat() or failed:
                    failed = False
                    rechecks = _LAPSE_RECHECKS
                    await self._send_lost_again(lapsed=True)
                elif rechecks:
                    # A worker that asked for this key just before it was renewed may
                    # still skip tasks it read then, after the check above: look again.
                    rechecks -= 1
                    await self._send_lost_again(lapsed=False)
            except (RedisConnectionLost, ReplyError, TimeoutError) as exc:
                failed = True
                log.debug("queue %r: client heartbeat: %s", self.queue, exc)

    async def _send_lost_again(self, *, lapsed: bool) -> None:
        """Send again the tasks in flight that workers settled with no reply to read.

        After a lapse of this client's heartbeat (its loop or its connection stalled, or
        Redis restarted empty) a worker may have skipped some of its tasks. A task whose
        entry is still in the task stream is queued or running and will answer; one
        whose entry is gone and whose reply is not in the reply stream (kept until this
        client's deadline) was skipped, or its reply was lost (Redis restarted): only
        those go again (a reply that comes after all is joined once).
        """
        await let_ready_tasks_run()  # replies the listener already holds resolve first
        flight = [p for p in self._pending.values() if p.sent and p.entry_id is not None]
        if not flight:
            return
        commands: list[list[Any]] = [
            ["XRANGE", self._task_stream, p.entry_id, p.entry_id] for p in flight
        ]
        commands.append(["XRANGE", self._reply_stream, "-", "+"])
        replies = await self._pool.pipeline(commands, max_bulk=self._max_bulk)
        answered: set[bytes] = set()
        if isinstance(replies[-1], list):
            for _entry_id, fields in replies[-1]:
                if isinstance(fields, list):
                    data = dict(zip(fields[::2], fields[1::2], strict=False))
                    hint = data.get(keys.F_TASK_HINT)
                    if isinstance(hint, bytes):
                        answered.add(hint)
        queued = {id(p) for p in self._outbox}
        again = [
            p
            for p, entry in zip(flight, replies, strict=False)
            if entry == []
            and p.task_id.encode() not in answered
            and self._pending.get(p.task_id) is p
            and id(p) not in queued
        ]
        if lapsed:
            log.warning(
                "queue %r: this client's heartbeat lapsed for over %g s (its event loop or "
                "its connection was blocked, or Redis restarted): %d of its %d task(s) in "
                "flight were settled without a reply to read; sending those again",
                self.queue,
                keys.CLIENT_TTL_MS / 1000,
                len(again),
                len(flight),
            )
        elif again:
            log.warning(
                "queue %r: %d task(s) in flight were skipped after this client's heartbeat "
                "came back (by a worker that found it gone just before); sending those again",
                self.queue,
                len(again),
            )
        if again:
            self.stats.resent += len(again)
            self._outbox += again
            self._flush_wanted.set()

    async def watch_deadlines(self) -> None:
        """Expire waits past ``timeout_s``: all share it, so the oldest expires first."""
        while True:
            now = anyio.current_time()
            wake = now + self.timeout_s
            while self._pending:
                oldest = next(iter(self._pending.values()))
                if oldest.deadline > now:
                    wake = oldest.deadline
                    break
                # Not cancelled yet: its waiter diagnoses first, then cancels it.
                del self._pending[oldest.task_id]
                oldest.timed_out = True
                self._wake(oldest)
            await anyio.sleep(max(wake - now, 0.001))

    def _cancel(self, pending: _Pending) -> None:
        """Forget a task this client stopped waiting for and tell the workers (off the caller's path)."""
        if self._pending.pop(pending.task_id, None) is not None:
            if pending.sent and not self.closed:  # a worker may hold it: it will report
                pending.reported = anyio.Event()
                self._reporting[pending.task_id] = pending
            self.send_cancel(pending)

    def send_cancel(self, pending: _Pending) -> None:
        pending.cancelled = True
        self.stats.cancelled += 1
        if not self.closed:
            self._cancels.append(pending)
            self._flush_wanted.set()

    async def diagnose(self, pending: _Pending) -> str:
        """Why a reply may be missing (``asyncgraph.distributed._diagnosis``)."""
        try:
            replies = await self._pool.pipeline(
                diagnosis.commands(self.queue, pending.entry_id),
                timeout_s=min(self._pool.timeout_s, 2.0),
                max_bulk=_DIAGNOSIS_MAX_BULK,
            )
            return diagnosis.explain(
                replies,
                queue=self.queue,
                task_id=pending.task_id,
                client_id=self.client_id,
                signed=self._signer.enabled,
                rejected_replies=self.stats.rejected_replies,
            )
        except (RedisConnectionLost, ReplyError, ValueError, TypeError, IndexError) as exc:
            return f"could not ask Redis why ({type(exc).__name__}: {exc})"

    # -- background tasks -----------------------------------------------------------
    async def flush_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            # What reaches the flusher was not sent by its submitter (see send_and_wait): more
            # nodes of its level, or of the waiters woken with it, or of another pass
            # or remote forward, may come in the next ticks. Wait until submissions stop
            # for two checkpoints (a few loop iterations, microseconds; two, not one:
            # trio runs each batch of tasks in either order), then send them together.
            # A level wider than _MAX_BATCH goes in several, the first leaving while the
            # rest are submitted; a submitter that sent everything leaves nothing here.
            size, quiet = len(self._outbox) + len(self._cancels), 0
            while size and quiet < _SETTLE_CHECKPOINTS and len(self._outbox) < _MAX_BATCH:
                await anyio.lowlevel.checkpoint()
                now = len(self._outbox) + len(self._cancels)
                quiet = quiet + 1 if now == size else 0
                size = now
            self._flush_wanted = anyio.Event()  # what comes during the trip goes in the next
            await self._flush()

    async def _flush(self, *, timeout_s: float | None = None, inline: bool = False) -> None:
        """Send what is batched (tasks, cancellations) in one round trip.

        ``inline``: called from a node's own task, which may be cancelled meanwhile:
        the send is not shielded (cancelling the caller takes effect at once), and
        the batch goes back to the flusher, which sends it again (a task sent twice
        is joined once). Otherwise shielded, bounded by the pool's deadline.
        """
        outbox, cancels = self._take_batch()
        commands = self._task_commands(outbox)
        held = [p for p in cancels if p.entry_id is not None]
        if cancels:
            # Queued entries are deleted (no worker will start them); running ones are
            # stopped by the workers watching the cancel stream, and report what they spent.
            commands += self._cancel_commands(held)
            commands.append(self._cancel_message_command(cancels))
        if not commands:
            return
        self.stats.flushes += 1
        self._flushing += 1
        try:
            # Sent again after a lost connection (they may have been added): a task sent
            # twice is joined once, its reply matched by task id; a cancel twice cancels once.
            replies = await self._pool.pipeline(
                commands, timeout_s=timeout_s, shield=not inline, retry=True
            )
        except RedisConnectionLost as exc:
            self._batch_lost(exc, outbox, cancels)
            return
        except Exception as exc:
            self._batch_failed(exc, outbox)
            return
        except BaseException:
            if inline:  # cancelled mid-send: the flusher sends the batch again
                self._put_back(outbox, cancels)
            raise
        finally:
            self._flushing -= 1
        self._read_entry_ids(outbox, replies)
        if held:
            self._read_cancels(held, replies[len(outbox) + 1 + 2 * len(held)])

    def _take_batch(self) -> tuple[list[_Pending], list[_Pending]]:
        """Empty the outbox and the cancels: the tasks still waited for (tasks cancelled,
        failed or timed out before they were sent are never sent), and the cancels of
        tasks that were sent."""
        pending = self._pending
        outbox = [p for p in self._outbox if not p.cancelled and pending.get(p.task_id) is p]
        cancels = [p for p in self._cancels if p.sent]
        self._outbox, self._cancels = [], []
        return outbox, cancels

    def _task_commands(self, outbox: list[_Pending]) -> list[list[Any]]:
        """One XADD to the task stream per task (marked sent)."""
        commands: list[list[Any]] = [
            [
                "XADD",
                self._task_stream,
                "*",
                keys.F_MESSAGE,
                p.packed,
                keys.F_SIGNATURE,
                p.signature,
                keys.F_CLIENT_HINT,
                self.client_id,
                keys.F_TASK_HINT,
                p.task_id,
                keys.F_BEATS_HINT,
                b"1",
            ]
            for p in outbox
        ]
        for p in outbox:
            p.sent = True
        return commands

    def _cancel_message_command(self, cancels: list[_Pending]) -> list[Any]:
        """The XADD to the cancel stream that tells the workers to stop ``cancels``."""
        packed, signature = encode(
            CancelMessage(self.queue, self.client_id, tuple(p.task_id for p in cancels)),
            self._signer,
        )
        return [
            "XADD",
            keys.cancel_stream(self.queue),
            "MAXLEN",
            "~",
            keys.CANCEL_MAXLEN,
            "*",
            keys.F_MESSAGE,
            packed,
            keys.F_SIGNATURE,
            signature,
        ]

    def _batch_lost(
        self, exc: RedisConnectionLost, outbox: list[_Pending], cancels: list[_Pending]
    ) -> None:
        """The connection was lost sending a batch: fail its tasks."""
        for p in outbox:
            self._fail(p, self._connection_error(exc, "sending the task"))
        for p in cancels:  # the workers may never hear of the cancel: no report to wait for
            self._reported(p)

    def _batch_failed(self, exc: Exception, outbox: list[_Pending]) -> None:
        """Not a network error (a bug, or a reply this client cannot parse): fail the whole
        batch with it, not only the task that happened to send it."""
        log.exception("queue %r: sending %d task(s) failed", self.queue, len(outbox))
        for p in outbox:
            self._fail(
                p,
                RemoteConnectionError(
                    f"sending the task to queue {self.queue!r} failed: {type(exc).__name__}: {exc}"
                ),
            )

    def _put_back(self, outbox: list[_Pending], cancels: list[_Pending]) -> None:
        """A batch whose send was cancelled goes back, first, for the flusher to send."""
        self._outbox[:0] = outbox
        self._cancels[:0] = cancels
        self._flush_wanted.set()

    def _read_entry_ids(self, outbox: list[_Pending], replies: list[Any]) -> None:
        """Each task's entry id in the task stream, from its XADD's reply; a task Redis
        refused fails."""
        for p, reply in zip(outbox, replies, strict=False):
            if isinstance(reply, ReplyError):
                self._fail(
                    p,
                    RemoteConnectionError(
                        f"Redis refused the task for {p.function!r} on queue {self.queue!r}: {reply}"
                    ),
                )
            else:
                p.entry_id = reply

    def _cancel_commands(self, cancels: list[_Pending]) -> list[list[Any]]:
        """One MULTI: per cancelled task, whether a worker holds it (the group's pending
        list: then it reports what it spent) and deleting its entry (1: it was still there)."""
        commands: list[list[Any]] = [["MULTI"]]
        for p in cancels:
            commands.append(["XPENDING", self._task_stream, keys.GROUP, p.entry_id, p.entry_id, 1])
            commands.append(["XDEL", self._task_stream, p.entry_id])
        return [*commands, ["EXEC"]]

    def _read_cancels(self, cancels: list[_Pending], done: Any) -> None:
        """Stop waiting for the report of each task ``_cancel_commands`` found queued, never
        delivered (deleted now: nothing of it ran). A task a worker holds reports; one
        already settled has its reply in the stream (or none: the wait is bounded)."""
        if not isinstance(done, list) or len(done) != 2 * len(cancels):
            return
        for p, delivered, deleted in zip(cancels, done[::2], done[1::2], strict=True):
            if delivered == [] and deleted == 1:
                self._reported(p)

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        if self._pending.pop(pending.task_id, None) is not None:
            pending.error = error
            self._wake(pending)

    def _wake(self, pending: _Pending) -> None:
        if pending.done is not None:  # submitted: no waiter (NOTE [Submitted nodes])
            if pending.timed_out:
                self.on_timeout(pending)  # diagnosed first, then its node is told
            else:
                pending.done.put(pending)
            return
        pending.woken = True
        self._waking += 1
        pending.event.set()

    def _connection_error(self, exc: Exception, doing: str) -> RemoteConnectionError:
        error = RemoteConnectionError(
            f"lost Redis while {doing} (queue {self.queue!r}): {exc}. The result of this "
            f"remote node cannot arrive; check Redis and run the backward again."
        )
        error.__cause__ = exc
        return error

    async def listen(self, conn: Connection | None) -> None:
        """Read this client's reply stream; survive outages, failing what they cut off."""
        last_id = b"0-0"
        trim_below: bytes | None = None
        backoff = 0.05
        try:
            while True:
                if conn is None:
                    try:
                        conn = await self.connect_listener()
                    except RedisConnectionLost as exc:
                        self._fail_all(exc, "waiting for the reply")
                        # Everything sent so far has failed: whichever Redis answers next
                        # holds only tasks sent after this point.
                        self._run_id = None
                        await anyio.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                        continue
                    backoff = 0.05
                commands: list[list[Any]] = []
                if trim_below is not None:  # drop what was read, in the same round trip
                    commands.append(["XTRIM", self._reply_stream, "MINID", trim_below])
                commands.append(
                    [
                        "XREAD",
                        "COUNT",
                        _READ_COUNT,
                        "BLOCK",
                        _BLOCK_MS,
                        "STREAMS",
                        self._reply_stream,
                        last_id,
                    ]
                )
                limit_s = _BLOCK_MS / 1000 + self._pool.timeout_s
                try:
                    replies = await conn.pipeline(
                        commands, max_bulk=self._max_bulk, timeout_s=limit_s
                    )
                    if isinstance(replies[-1], ReplyError):
                        raise RedisConnectionLost(
                            f"XREAD of the reply stream failed: {replies[-1]}"
                        )
                except (RedisConnectionLost, TimeoutError) as exc:
                    what = (
                        str(exc)
                        if isinstance(exc, RedisConnectionLost)
                        else (
                            f"Redis at {self._pool.address.display} did not answer the blocking "
                            f"read of the reply stream within {limit_s:g}s"
                        )
                    )
                    log.warning("reply listener of queue %r: %s; reconnecting", self.queue, what)
                    self.stats.reconnects += 1
                    await conn.aclose()
                    conn = None  # reconnect at once; if that fails, the waiting nodes fail
                    continue
                trim_below = None
                if replies[-1]:
                    entries = replies[-1][0][1]
                    for _entry_id, fields in entries:
                        self._on_reply(fields)
                    await self._before_next_read()
                    last_id = entries[-1][0]
                    trim_below = _next_id(last_id)
        finally:
            if conn is not None:
                await conn.aclose()

    async def _before_next_read(self) -> None:
        """Let the nodes just resolved run before this client writes to Redis again.

        Sending the next blocking read wakes the Redis server, which on a busy host
        takes the CPU from this process: the resolved nodes would wait for it. So the
        read is sent once they had their turn, and when no task of this client is in
        flight (nothing to read), after the next submission went out, or after
        ``_IDLE_READ_DELAY_S`` (late replies, of tasks that ran twice, are then read).
        """
        await let_ready_tasks_run()
        if not self._pending:
            self._submitted = anyio.Event()
            with anyio.move_on_after(_IDLE_READ_DELAY_S):
                await self._submitted.wait()
                await let_ready_tasks_run()  # its flush is sent first

    async def connect_listener(self) -> Connection:
        """A connection for the listener; fails the waiting nodes if Redis restarted meanwhile."""
        conn = await self._pool.connect()
        if self._pool.address.cluster:
            # Each master has its own run_id and the queue's slot may move to another one:
            # in a Cluster, tasks lost with a master are found by their deadlines.
            return conn
        try:
            run_id = await _run_id(conn, self._pool.timeout_s)
        except BaseException:
            await conn.aclose()
            raise
        if self._run_id is not None and run_id != self._run_id:
            self._fail_all(
                RedisConnectionLost(
                    f"Redis at {self._pool.address.display} restarted: tasks and replies in flight "
                    f"were lost"
                ),
                "waiting for the reply",
            )
        self._run_id = run_id
        return conn

    def _fail_all(self, exc: Exception, doing: str) -> None:
        for pending in list(self._pending.values()):
            if pending.sent:
                self._fail(pending, self._connection_error(exc, doing))
        for pending in list(self._reporting.values()):  # their reports are lost with Redis
            self._reported(pending)

    def _on_reply(self, fields: list[Any]) -> None:
        data = dict(zip(fields[::2], fields[1::2], strict=False))
        packed = data.get(keys.F_MESSAGE)
        try:
            if isinstance(packed, Oversize):
                raise WireError(
                    f"the reply is {packed.size} bytes, above this client's limit of "
                    f"{self._limits.max_message_bytes} (it was not read); raise "
                    f"limits=Limits(max_message_bytes=...) here or return less data"
                )
            message = decode(
                packed, data.get(keys.F_SIGNATURE), self._signer, self.queue, self._limits
            )
            if not isinstance(message, ReplyMessage) or message.client != self.client_id:
                raise WireError("not a reply to this client")
        except WireError as exc:
            self._on_rejected_reply(data, packed, exc)
            return
        pending = self._pending.pop(message.id, None)
        if pending is None:
            cancelled = self._reporting.get(message.id)
            if cancelled is not None:  # its worker's report: what the cancelled task spent
                cancelled.reply = message
                self._reported(cancelled)
                return
            self.stats.duplicate_replies += 1  # ran twice, cancelled, or timed out: joined once
            return
        pending.reply = message
        self._wake(pending)

    def _on_rejected_reply(self, data: dict[Any, Any], packed: Any, exc: WireError) -> None:
        """Count and log a reply this client refuses; fail its task now if it can be named."""
        self.stats.rejected_replies += 1
        task_id: str | None = None
        hint = data.get(keys.F_TASK_HINT)
        if isinstance(hint, bytes):
            task_id = hint.decode(errors="replace")
        else:
            ids = peek_ids(packed, self.queue, "reply")
            if ids is not None and ids[0] == self.client_id:
                task_id = ids[1]
        pending = self._pending.get(task_id) if task_id is not None else None
        log.warning(
            "rejected a reply on queue %r%s: %s",
            self.queue,
            f" for task {task_id}" if task_id else "",
            exc,
        )
        if pending is None:
            return
        if "signature" in str(exc) or "unsigned" in str(exc):
            advice = (
                f"; the client and the workers must share one secret (secret= here, "
                f"{SECRET_ENV} on both sides)"
            )
        else:
            advice = ""
        self._fail(
            pending,
            RemoteError(
                f"its reply from the workers of queue {self.queue!r} was rejected: {exc}{advice}"
            ),
        )

    async def close(self) -> None:
        """Cancel what still waits, flush cancellations, delete the reply stream (bounded)."""
        self.closed = True
        for pending in list(self._reporting.values()):
            self._reported(pending)
        for pending in list(self._pending.values()):
            pending.cancelled = True
            self._cancels.append(pending)
            self._fail(
                pending,
                RuntimeError(
                    f"the RedisExecutor of queue {self.queue!r} was closed while this node waited"
                ),
            )
        if self.stats.submitted:  # else there is nothing to cancel or delete
            with anyio.move_on_after(self._pool.timeout_s, shield=True):
                try:
                    await self._flush(timeout_s=self._pool.timeout_s)
                    await self._pool.pipeline(
                        [
                            ["DEL", self._reply_stream, self._client_key],
                        ]
                    )
                except (RedisConnectionLost, ReplyError) as exc:
                    log.warning("closing the executor of queue %r: %s", self.queue, exc)
        with anyio.CancelScope(shield=True):
            await self._pool.aclose()


def _next_id(entry_id: bytes) -> bytes:
    ms, _, seq = entry_id.partition(b"-")
    return ms + b"-" + str(int(seq or b"0") + 1).encode()


async def _run_id(conn: Connection, timeout_s: float) -> bytes:
    """The server's run_id: it changes when Redis restarts (and forgets non-persisted data)."""
    try:
        with anyio.fail_after(timeout_s):
            info = await conn.execute("INFO", "server")
    except TimeoutError:
        raise RedisConnectionLost(
            f"Redis at {conn.address.display} did not answer within {timeout_s:g}s"
        ) from None
    for line in bytes(info).splitlines():
        if line.startswith(b"run_id:"):
            return line[7:].strip()
    return b""
