"""The task runner: one task per admitted entry, stopped at its deadline or when cancelled.

While ``serving()``, ``start(held, fn, *args)`` runs ``await fn(*args)`` in a task of
its own; ``stop(held, reason)`` stops it (``reason``: ``"cancelled"``, a cancel message
came), and so does its deadline (``held.deadline`` on the anyio clock; reason
``"expired"``). A stopped task sees the event loop's cancellation exception
(``anyio.get_cancelled_exc_class()``) at its next checkpoint, with ``held.stopped``
saying why (``why_stopped``); one stopped before it began sees ``held.stopped`` set
when it begins. ``stop_all()`` cancels every task with ``held.stopped`` left None (the
worker is stopping: the tasks are handed back, not settled).

One implementation on anyio's public API, for every event loop: an anyio task group,
each task in a cancel scope with its deadline. A Function that swallows one
cancellation is cancelled again at its next checkpoint, as a cancel scope does.

A task that raises (a bug of the worker: ``Tasks._run`` catches what a Function
raises) stops the ``serving()`` block, and the error is raised from it, as a task
group would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from asyncgraph.distributed.worker._outcomes import Held

__all__ = ["Runner"]

Run = Callable[..., Awaitable[None]]


class Runner:
    """Runs each held task in a task of its own while ``serving()``; stops them.

    One per worker (``Slots.runner``), made with it; its tasks live in the task group
    that ``serving()`` opens.
    """

    def __init__(self) -> None:
        self._group: anyio.abc.TaskGroup | None = None

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Runner]:
        """Tasks may start in this block; leaving it waits for them, as a task group.

        Left by an exception or a cancellation, the block stops them all first.
        """
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                yield self
        finally:
            self._group = None

    def start(self, held: Held, fn: Run, *args: Any) -> None:
        """Run ``await fn(*args)`` in a task of its own, under ``held.deadline``."""
        if self._group is None:
            raise RuntimeError("a task can start only inside the runner's serving() block")
        self._group.start_soon(self._body, held, fn, args)

    async def _body(self, held: Held, fn: Run, args: tuple[Any, ...]) -> None:
        with anyio.CancelScope(deadline=held.deadline) as scope:
            held.scope = scope
            await fn(*args)

    def stop(self, held: Held, reason: str) -> None:
        """Stop ``held``'s task, begun or not (the first reason stands)."""
        if held.stopped is not None:
            return
        held.stopped = reason
        if held.scope is not None:
            held.scope.cancel()

    def stop_all(self) -> None:
        """Cancel every task now, with no reason (the worker stops: they are handed back)."""
        if self._group is not None:
            self._group.cancel_scope.cancel()

    def why_stopped(self, held: Held) -> str | None:
        """Why ``held``'s task, which just caught the cancellation exception, was stopped.

        None: not by its own stop (the runner is stopping): re-raise it. Otherwise the
        task owns the cancellation, and may end normally.
        """
        scope = held.scope
        if held.stopped is None and scope is not None and scope.cancel_called:
            held.stopped = "expired"  # its own scope's deadline
        return held.stopped
