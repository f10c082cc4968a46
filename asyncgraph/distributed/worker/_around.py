"""The task hooks around one task on a worker (``asyncgraph.taskhooks``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from asyncgraph.taskhooks import TaskHook, TaskInfo

__all__ = ["AroundTask"]

log = logging.getLogger("asyncgraph.distributed.worker")


class AroundTask:
    """Every installed hook entered around one task; ``metadata()`` is what they send back.

    What a client sent must never crash a worker, nor a hook lose a task's reply: a
    hook that fails to enter is logged and left out, one that fails to exit or to
    give its metadata is logged. Hooks exit in reverse order, with the exception
    that ends the block, which none may suppress. A plain class, not an
    ``ExitStack``: it is built around every task a worker runs.
    """

    __slots__ = ("_consumer", "_entered")

    def __init__(
        self, hooks: Mapping[str, TaskHook], sent: Mapping[str, Any], info: TaskInfo, consumer: str
    ) -> None:
        self._consumer = consumer
        self._entered: list[tuple[str, AbstractContextManager[Any], Callable[[], Any]]] = []
        for name, hook in hooks.items():
            try:
                manager = hook.around_task(sent.get(name), info)
                get = manager.__enter__()
            except Exception:
                log.exception("worker %s: task hook %r failed before a task", consumer, name)
                continue
            self._entered.append((name, manager, get))

    def __enter__(self) -> AroundTask:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for name, manager, _ in reversed(self._entered):
            try:
                manager.__exit__(*exc_info)
            except Exception:
                log.exception("worker %s: task hook %r failed after a task", self._consumer, name)

    def metadata(self) -> dict[str, Any] | None:
        """What each hook sends back to the client (None: nothing), read once the block ended."""
        meta = {}
        for name, _, get in self._entered:
            try:
                value = get()
            except Exception:
                log.exception("worker %s: task hook %r failed after a task", self._consumer, name)
                continue
            if value is not None:
                meta[name] = value
        return meta or None
