"""Where a node's backward runs.

The engine talks to one small protocol, :class:`Executor`; the in-process
:class:`LocalExecutor` (the default) and the Redis-fed distributed executor
(``asyncgraph.distributed.RedisExecutor``) are peers behind it, and tests can plug in
a third. This package is part of the core: ``RedisExecutor`` and
``open_redis_executor`` are lazy aliases of ``asyncgraph.distributed``'s, loaded only
when asked for, so ``import asyncgraph`` never loads the distributed half.
"""

from typing import Any

from asyncgraph._executor import BatchingExecutor, Executor, current_executor, use_executor
from asyncgraph._local_executor import LocalExecutor
from asyncgraph._yield import let_ready_tasks_run

__all__ = [
    "BatchingExecutor",
    "Executor",
    "LocalExecutor",
    "RedisExecutor",
    "current_executor",
    "let_ready_tasks_run",
    "open_redis_executor",
    "use_executor",
]

_DISTRIBUTED = ("RedisExecutor", "open_redis_executor")


def __getattr__(name: str) -> Any:
    if name in _DISTRIBUTED:
        import asyncgraph.distributed as distributed  # the lazy alias: see the docstring

        return getattr(distributed, name)
    raise AttributeError(f"module 'asyncgraph.executors' has no attribute {name!r}")
