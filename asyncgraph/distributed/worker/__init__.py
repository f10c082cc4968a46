"""The worker that serves remote backwards from a Redis queue (``asyncgraph worker``).

Use the command (``asyncgraph worker --redis URL --queue grads --import
myapp.functions``), or embed a worker in a program::

    registry = build_registry(["myapp.functions"])
    await Worker(WorkerConfig(redis_url="redis://127.0.0.1:6379/0"), registry).serve()
"""

from asyncgraph.distributed.worker._config import SETTINGS, ConfigError, Setting, WorkerConfig
from asyncgraph.distributed.worker._registry import RegisteredFunction, Registry, build_registry
from asyncgraph.distributed.worker._supervisor import Supervisor
from asyncgraph.distributed.worker._worker import Worker

__all__ = [
    "SETTINGS",
    "ConfigError",
    "Setting",
    "RegisteredFunction",
    "Registry",
    "Supervisor",
    "Worker",
    "WorkerConfig",
    "build_registry",
]
