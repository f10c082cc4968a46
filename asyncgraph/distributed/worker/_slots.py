"""The tasks one worker holds: the state its parts share, read instead of called back.

A slot is taken when an entry is read (``hold``) and freed when what settled it is
written to Redis (``release``), not when it ends: until then the entry is pending,
its lease renewed. A synchronous call abandoned in its thread (see ``Threads``) takes
no slot: its task was settled or handed back, and a worker whose abandoned calls
would take every slot would stop serving for nothing wrong with the next tasks. They
are bounded instead (``max_abandoned``; see NOTE [Abandoned calls] in ``_worker``).
The intake reads ``free`` before each read, the lease renewer reads ``held``, a
cancel message stops ``running[key]``, and a drain waits for ``wait_idle``.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from asyncgraph.distributed.worker._execute import Threads
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._outcomes import Held
from asyncgraph.distributed.worker._runner import Runner

__all__ = ["Slots"]

FINISHED_MEMORY = 4096  # entry ids of tasks just settled, not to be re-run if reclaimed late


class Slots:
    """At most ``concurrency`` tasks held at once; abandoned thread calls apart.

    ``held``: read, not yet acknowledged (by entry id). ``running``: admitted and not
    yet settled (by client and task id): the ones a cancel message can stop.
    ``runner``: the task runner, which runs them while the worker serves.
    ``too_many_abandoned`` is called when a call is abandoned beyond ``max_abandoned``
    (``Worker`` drains then, to be replaced).
    """

    def __init__(
        self,
        concurrency: int,
        metrics: Metrics,
        max_abandoned: int = 0,
        *,
        too_many_abandoned: Callable[[], None] = lambda: None,
    ) -> None:
        self.concurrency = concurrency
        self.max_abandoned = max_abandoned or concurrency
        # Threads for the tasks held plus the abandoned calls allowed: on trio an
        # abandoned call keeps its thread's limiter token until it returns.
        self.threads = Threads(
            concurrency + self.max_abandoned, on_abandoned=self._abandoned, on_ended=self.changed
        )
        self._too_many_abandoned = too_many_abandoned
        self.runner = Runner()
        self.held: dict[bytes, Held] = {}
        self.settled = 0
        """Tasks this worker settled (replied to or dead-lettered) since it started; its
        status line carries it, and ``asyncgraph status`` takes a rate from two readings."""
        self.running: dict[tuple[str, str], Held] = {}
        self._finished: dict[bytes, None] = {}
        self._metrics = metrics
        self._changed: anyio.Event | None = None

    @property
    def abandoned(self) -> int:
        """Synchronous calls cancelled but still running in their threads."""
        return self.threads.abandoned

    @property
    def free(self) -> int:
        """How many more tasks this worker may take now (0 or less: none)."""
        return self.concurrency - len(self.held)

    def _abandoned(self) -> None:
        self.changed()
        if self.threads.abandoned > self.max_abandoned:
            self._too_many_abandoned()

    def hold(self, entry_id: bytes, delivery: int) -> Held | None:
        """Take a slot for ``entry_id``; None if it is held already, or was settled a moment ago.

        A settled entry comes back when an XAUTOCLAIM ran just before its reply was
        written (after a stall past the lease): it must not run twice.
        """
        if entry_id in self.held or entry_id in self._finished:
            return None
        held = self.held[entry_id] = Held(entry_id, delivery=delivery)
        return held

    def stop(self, key: tuple[str, str], reason: str) -> None:
        """Stop the running task ``key`` (client and task id), if this worker runs it."""
        held = self.running.get(key)
        if held is not None:
            self.runner.stop(held, reason)

    def release(self, entry_ids: list[bytes]) -> None:
        """``entry_ids`` were settled in Redis: free their slots."""
        for entry_id in entry_ids:
            if self.held.pop(entry_id, None) is not None:
                self.settled += 1
            self._finished[entry_id] = None
        while len(self._finished) > FINISHED_MEMORY:
            del self._finished[next(iter(self._finished))]
        self.changed()

    def drop(self, entry_id: bytes) -> None:
        """Free the slot of ``entry_id`` unsettled: it stays pending in Redis, unrenewed, and
        a reclaimer takes it once its lease has passed (this worker's, or another's)."""
        if self.held.pop(entry_id, None) is not None:
            self.changed()

    def changed(self) -> None:
        """A slot may be free again: update the gauges, wake whoever waits."""
        self._metrics.set("asyncgraph_worker_tasks_in_flight", len(self.held))
        self._metrics.set("asyncgraph_worker_abandoned_calls", self.threads.abandoned)
        if self._changed is not None:
            self._changed.set()

    async def wait_free(self) -> int:
        """Wait until a slot is free; the number free."""
        while (free := self.free) <= 0:
            await self._next_change()
        return free

    async def wait_idle(self) -> None:
        """Wait until this worker holds nothing."""
        while self.held:
            await self._next_change()

    async def _next_change(self) -> None:
        # One event for every waiter (the reader, a drain): each re-checks its condition.
        if self._changed is None or self._changed.is_set():
            self._changed = anyio.Event()
        await self._changed.wait()
