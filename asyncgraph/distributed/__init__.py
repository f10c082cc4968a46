"""Everything that crosses a process boundary: the Redis-fed worker fleet.

- the client side: ``open_redis_executor`` / ``RedisExecutor``, an ``Executor`` that
  sends remote nodes' backwards to workers through Redis streams;
- the wire protocol (``asyncgraph.distributed.wire``: key names, message schema,
  msgpack codec with limits, signing, how a Function's ctx travels);
- the worker (``Worker``, ``WorkerConfig``, ``build_registry``), and what the
  ``asyncgraph worker`` command runs beside it: a supervisor of its processes, health
  and metrics;
- fleet helpers: ``RedisServer`` (a throwaway redis-server), ``local_fleet``,
  ``live_workers``.

Imports go one way: this package uses the core and the leaf Redis client
(``asyncgraph.resp``); the core never imports it.
"""

from typing import TYPE_CHECKING

from asyncgraph._lazy import lazy_exports

if TYPE_CHECKING:  # loaded on first use (``asyncgraph._lazy``): the Redis client is heavy
    from asyncgraph.distributed._executor import RedisExecutor, open_redis_executor
    from asyncgraph.distributed._fleet import (
        FleetError,
        live_workers,
        local_fleet,
        wait_for_workers,
    )
    from asyncgraph.distributed._redis_server import RedisServer
    from asyncgraph.distributed.wire._keys import check_queue_name
    from asyncgraph.distributed.wire._limits import Limits
    from asyncgraph.distributed.worker._config import ConfigError, WorkerConfig
    from asyncgraph.distributed.worker._registry import build_registry
    from asyncgraph.distributed.worker._worker import Worker

__all__ = [
    "ConfigError",
    "FleetError",
    "Limits",
    "RedisExecutor",
    "RedisServer",
    "Worker",
    "WorkerConfig",
    "build_registry",
    "check_queue_name",
    "live_workers",
    "local_fleet",
    "open_redis_executor",
    "wait_for_workers",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ConfigError": ".worker._config",
        "FleetError": "._fleet",
        "Limits": ".wire._limits",
        "RedisExecutor": "._executor",
        "RedisServer": "._redis_server",
        "Worker": ".worker._worker",
        "WorkerConfig": ".worker._config",
        "build_registry": ".worker._registry",
        "check_queue_name": ".wire._keys",
        "live_workers": "._fleet",
        "local_fleet": "._fleet",
        "open_redis_executor": "._executor",
        "wait_for_workers": "._fleet",
    },
)
