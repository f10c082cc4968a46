"""Where a node's backward runs.

The engine talks to one small protocol, :class:`Executor`; the in-process
:class:`LocalExecutor` (the default) and the Redis-fed distributed executor are
peers behind it, and tests can plug in a third.
"""

from ._base import Executor, current_executor, use_executor
from ._local import LocalExecutor

__all__ = ["Executor", "LocalExecutor", "current_executor", "use_executor"]
