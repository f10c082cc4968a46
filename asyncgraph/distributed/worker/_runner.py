"""The task runner: one task per admitted entry, stopped at its deadline or when cancelled.

``start(held, fn, *args)`` runs ``await fn(*args)`` in a task of its own; ``stop(held, reason)``
stops it (``reason``: ``"cancelled"``, a cancel message came), and so does its deadline
(``held.deadline`` on the anyio clock; reason ``"expired"``). A stopped task sees the
event loop's cancellation exception at its next checkpoint, with ``held.stopped``
saying why (``why_stopped``); one stopped before it began sees ``held.stopped`` set
when it begins.
``stop_all()`` cancels every task with ``held.stopped`` left None (the worker is
stopping: the tasks are handed back, not settled).

Two implementations of that one face, picked by the event loop:

- asyncio: a bare asyncio task per entry, its deadline a loop timer. An anyio task
  (its handle, cancel scope and task state) and a cancel scope per entry cost about
  20 us a task, a third of the worker's CPU for a no-op task (measured in
  ``benchmarks/dist_breakdown.py``'s terms: about 55 us to 40 us in process);
- trio: an anyio task group, each task in a cancel scope with its deadline.

A task that raises (a bug of the worker: ``Worker._run`` catches what a Function
raises) stops the runner's block, and the error is raised from it, as a task group
would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc

from asyncgraph.distributed.worker._outcomes import Held

__all__ = ["Runner", "open_runner"]

Run = Callable[..., Awaitable[None]]
RECANCEL_S = 0.1  # a stopped asyncio task still running is cancelled again this often


class Runner(Protocol):
    cancelled: type[BaseException]  # the event loop's cancellation exception
    now: Callable[[], float]  # the event loop's clock (anyio.current_time, minus its dispatch)

    def start(self, held: Held, fn: Run, *args: Any) -> None: ...

    def stop(self, held: Held, reason: str) -> None: ...

    def stop_all(self) -> None: ...

    def why_stopped(self, held: Held) -> str | None:
        """Why ``held``'s task, which just caught the cancellation exception, was stopped.

        None: not by its own stop (the runner is stopping): re-raise it. Otherwise the
        task owns the cancellation, and may end normally.
        """


@asynccontextmanager
async def open_runner() -> AsyncIterator[Runner]:
    """A runner for this event loop; leaving the block waits for its tasks, as a task group.

    Left by an exception or a cancellation, the block stops them all first.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio
        async with anyio.create_task_group() as group:
            yield _ScopedRunner(group)
        return
    runner = _AsyncioRunner(loop)
    with anyio.CancelScope() as scope:
        runner.crashed = scope.cancel
        try:
            yield runner
            await runner.wait_all()  # cancelled by a crash, or from outside
        finally:
            runner.stop_all()
            with anyio.CancelScope(shield=True):
                await runner.wait_all()
    if runner.error is not None:
        raise runner.error


class _AsyncioRunner:
    cancelled: type[BaseException] = asyncio.CancelledError

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = loop.time
        self._tasks: dict[asyncio.Task[None], Held] = {}
        self._all_done: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.crashed: Callable[[], None] = lambda: None

    def start(self, held: Held, fn: Run, *args: Any) -> None:
        task = self._loop.create_task(self._body(held, fn, args))
        held.handle = task
        self._tasks[task] = held
        task.add_done_callback(self._done)

    async def _body(self, held: Held, fn: Run, args: tuple[Any, ...]) -> None:
        if held.stopped is not None:
            await fn(*args)  # stopped before it began: it settles at once
            return
        timer = self._loop.call_at(held.deadline, self.stop, held, "expired")
        held.started = True
        try:
            await fn(*args)
        finally:
            timer.cancel()

    def stop(self, held: Held, reason: str) -> None:
        if held.stopped is not None:
            return
        held.stopped = reason
        task = held.handle
        if held.started and isinstance(task, asyncio.Task):
            self._cancel_until_done(task)

    def stop_all(self) -> None:
        for task in self._tasks:
            self._cancel_until_done(task)

    def _cancel_until_done(self, task: asyncio.Task[None]) -> None:
        """Cancel ``task``, and again every ``RECANCEL_S`` while it runs on.

        As an anyio cancel scope does at every checkpoint: a Function that swallowed
        one cancellation (``except CancelledError``) still ends.
        """
        if not task.done():
            task.cancel()
            self._loop.call_later(RECANCEL_S, self._cancel_until_done, task)

    def why_stopped(self, held: Held) -> str | None:
        if held.stopped is not None:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        return held.stopped

    def _done(self, task: asyncio.Task[None]) -> None:
        del self._tasks[task]
        if not task.cancelled():
            error = task.exception()
            if error is not None and self.error is None:
                self.error = error
                self.crashed()
        if not self._tasks and self._all_done is not None and not self._all_done.done():
            self._all_done.set_result(None)

    async def wait_all(self) -> None:
        if self._tasks:
            self._all_done = self._loop.create_future()
            await self._all_done


class _ScopedRunner:
    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self._group = group
        self.cancelled = anyio.get_cancelled_exc_class()
        self.now = anyio.current_time

    def start(self, held: Held, fn: Run, *args: Any) -> None:
        self._group.start_soon(self._body, held, fn, args)

    async def _body(self, held: Held, fn: Run, args: tuple[Any, ...]) -> None:
        with anyio.CancelScope(deadline=held.deadline) as scope:
            held.handle = scope
            held.started = True
            await fn(*args)

    def stop(self, held: Held, reason: str) -> None:
        if held.stopped is not None:
            return
        held.stopped = reason
        if isinstance(held.handle, anyio.CancelScope):
            held.handle.cancel()

    def stop_all(self) -> None:
        self._group.cancel_scope.cancel()

    def why_stopped(self, held: Held) -> str | None:
        if held.stopped is None and isinstance(held.handle, anyio.CancelScope):
            if held.handle.cancel_called:  # its own scope's deadline
                held.stopped = "expired"
        return held.stopped
