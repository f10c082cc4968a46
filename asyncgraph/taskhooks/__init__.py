"""Task hooks: what a policy layer does around remote work, without the transport knowing it.

A leaf (it imports nothing of asyncgraph), so that any layer can install a hook and
the fleet can run them. The distributed half moves tasks and replies; it knows
nothing of models. A layer with a policy about remote work (``asyncgraph.models``:
the usage a task's model calls spent, the base URLs a worker may send its API key
to) installs a hook here when it is imported, and the fleet runs every installed hook:

- ``serving(settings)`` when a worker starts serving (``settings``: plain values such
  as ``{"allowed_base_urls": (...), "redis_url": ..., "redis_timeout_s": ...}``); it
  returns the function that undoes it;
- ``task_metadata()`` on the client, when a task is sent, in the context of the node
  that sends it: what its worker side should know (None: nothing; e.g. the trace
  context of the node's span);
- ``around_task(metadata, info)`` on the worker, around each task, with what the client
  side sent (None if nothing) and what the task is (``TaskInfo``): a context manager
  whose value, called once the task ends, gives the metadata to send back (None:
  nothing);
- ``on_reply(metadata)`` on the client, with what its hook sent back.

A task and its reply carry an opaque metadata map, one entry per hook name: the wire checks its
shape and size, never its meaning. Metadata from a hook the client has not
installed is ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

__all__ = ["TaskHook", "TaskInfo", "install_task_hook", "task_hooks", "uninstall_task_hook"]


@dataclass(frozen=True)
class TaskInfo:
    """What a worker's hooks learn of the task they run around.

    Example::

        @contextmanager
        def around_task(self, metadata, info):        # a TaskHook's, on the worker
            print(info.function, info.op, info.queue, info.delivery, info.queued_s)
            yield lambda: None
    """

    function: str  # the registered name
    op: str  # "backward" or "forward"
    queue: str
    worker: str  # the worker's consumer name
    task_id: str
    queued_s: float  # from the client's XADD to the start of the run (Redis's clock)
    delivery: int  # 1, or more when reclaimed from a worker that died or stalled
    # A Redis key (on the fleet's Redis, in the queue's hash slot) that belongs to this task
    # and outlives a delivery: where a hook journals what a rerun should not do again (the
    # models hook: the model calls already paid for). Empty: none.
    journal_key: str = ""
    rerun_s: float = 0.0  # how long the task may still be rerun (the client's wait): 0 unknown


class TaskHook(Protocol):
    """What a layer installs to act around each remote task, on the client and the worker.

    ``name`` keys the hook (installing a hook of the same name replaces it);
    ``serving(settings)`` runs once when a worker starts serving and returns a function
    that undoes it; ``task_metadata()`` is called on the client when a task is sent and
    returns plain data that travels with it; ``around_task(metadata, info)`` wraps the
    task's run on the worker and yields a function whose result travels back with the
    reply; ``on_reply(metadata)`` receives it on the client.

    Example::

        class Timing:  # how long each remote task ran, reported back to the client
            name = "timing"

            def serving(self, settings):
                return lambda: None

            def task_metadata(self):
                return None

            @contextmanager
            def around_task(self, metadata, info):
                start = time.perf_counter()
                yield lambda: time.perf_counter() - start

            def on_reply(self, metadata):
                print(f"the task ran {metadata:.3f}s")

        install_task_hook(Timing())     # in the client and in a module the workers import
    """

    name: str

    def serving(self, settings: Mapping[str, Any]) -> Callable[[], None]: ...

    def task_metadata(self) -> Any: ...

    def around_task(
        self, metadata: Any, info: TaskInfo
    ) -> AbstractContextManager[Callable[[], Any]]: ...

    def on_reply(self, metadata: Any) -> None: ...


_lock = threading.Lock()
# Copy-on-write: installing replaces the map, so a view handed out is a stable snapshot
# and reading one costs no lock and no copy (a worker reads it around every task).
_hooks: Mapping[str, TaskHook] = MappingProxyType({})


def install_task_hook(hook: TaskHook) -> None:
    """Install ``hook`` under ``hook.name`` (replacing one of the same name).

    Example::

        install_task_hook(Timing())           # replaces a hook named "timing", if any
    """
    global _hooks
    name = getattr(hook, "name", None)
    if not isinstance(name, str) or not 0 < len(name) <= 32:
        raise ValueError(f"a task hook needs a name of 1 to 32 characters, got {name!r}")
    with _lock:
        _hooks = MappingProxyType({**_hooks, name: hook})


def uninstall_task_hook(name: str) -> None:
    """Remove the hook installed under ``name`` (nothing happens if there is none).

    Example::

        uninstall_task_hook("timing")
    """
    global _hooks
    with _lock:
        if name in _hooks:
            _hooks = MappingProxyType({k: v for k, v in _hooks.items() if k != name})


def task_hooks() -> Mapping[str, TaskHook]:
    """The installed hooks by name: a read-only snapshot (later installs do not change it).

    Example::

        print(sorted(task_hooks()))           # e.g. ['models', 'timing']
    """
    return _hooks
