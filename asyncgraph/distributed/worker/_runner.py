"""The task runner: one task per admitted entry, stopped at its deadline or when cancelled.

``start(held, fn, *args)`` runs ``await fn(*args)`` in a task of its own; ``stop(held, reason)``
stops it (``reason``: ``"cancelled"``, a cancel message came), and so does its deadline
(``held.deadline`` on the anyio clock; reason ``"expired"``). A stopped task sees the
event loop's cancellation exception at its next checkpoint, with ``held.stopped``
saying why (``why_stopped``); one stopped before it began sees ``held.stopped`` set
when it begins.
``stop_all()`` cancels every task with ``held.stopped`` left None (the worker is
stopping: the tasks are handed back, not settled).

One implementation on anyio's public API, for every event loop: an anyio task group,
each task in a cancel scope with its deadline. A Function that swallows one
cancellation is cancelled again at its next checkpoint, as a cancel scope does.

A task that raises (a bug of the worker: ``Tasks._run`` catches what a Function
raises) stops the runner's block, and the error is raised from it, as a task group
would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.abc

from asyncgraph.distributed.worker._outcomes import Held

__all__ = ["Runner", "open_runner"]

Run = Callable[..., Awaitable[None]]


class Runner(Protocol):
    cancelled: type[BaseException]  # the event loop's cancellation exception
    now: Callable[[], float]  # the event loop's clock (anyio.current_time)

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
    async with anyio.create_task_group() as group:
        yield _ScopedTasks(group)


class _ScopedTasks:
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
