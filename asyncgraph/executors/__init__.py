"""Where a node's backward runs.

The engine talks to one small protocol, :class:`Executor`; the in-process
:class:`LocalExecutor` (the default) and the Redis-fed distributed executor are
peers behind it, and tests can plug in a third.
"""

from asyncgraph.executors._base import Executor, current_executor, more_nodes_coming, use_executor
from asyncgraph.executors._local import LocalExecutor
from asyncgraph.executors._redis import RedisExecutor, open_redis_executor

__all__ = [
    "Executor",
    "LocalExecutor",
    "RedisExecutor",
    "current_executor",
    "more_nodes_coming",
    "open_redis_executor",
    "use_executor",
]
