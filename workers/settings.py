"""The service's settings, read from ``ASYNCGRAPH_*`` environment variables.

==============================  ===========================  ==================================
variable                        default                      meaning
==============================  ===========================  ==================================
ASYNCGRAPH_REDIS_URL            (required)                   redis://, rediss://, user:pass@...
ASYNCGRAPH_QUEUE                grads                        queue served
ASYNCGRAPH_IMPORTS              asyncgraph.text,             comma-separated function modules
                                asyncgraph.jobs.demo,
                                workers.functions
ASYNCGRAPH_CONCURRENCY          64                           tasks per process at once
ASYNCGRAPH_PROCESSES            1                            worker processes (supervised)
ASYNCGRAPH_SECRET               (none)                       shared HMAC secret, >= 16 bytes
ASYNCGRAPH_ALLOWED_BASE_URLS    (none)                       model base URLs tasks may name,
                                                             comma-separated (the default
                                                             OpenAI URL is always allowed)
ASYNCGRAPH_LEASE_MS             10000                        reclaim silent tasks after this
ASYNCGRAPH_MAX_ATTEMPTS         3                            deliveries before dead-lettering
ASYNCGRAPH_DRAIN_TIMEOUT_S      30                           on SIGTERM, time to finish tasks
ASYNCGRAPH_CONNECT_TIMEOUT_S    0                            at start, retry Redis this long
                                                             (0: until it answers)
ASYNCGRAPH_HEALTH_PORT          9100                         /livez, /readyz, /metrics ("" = off)
ASYNCGRAPH_BACKEND              asyncio                      asyncio or trio
ASYNCGRAPH_LOG_LEVEL            INFO                         logging level
==============================  ===========================  ==================================

Every other ``asyncgraph worker`` flag has its variable too (``--batch-size``:
``ASYNCGRAPH_BATCH_SIZE``...): the table of settings is
``asyncgraph.distributed.worker.SETTINGS``, read once by ``WorkerConfig.from_env``,
which raises ``ValueError`` naming the variable that is missing or wrong. The only
differences of the service from the command: a required Redis URL, the example
functions by default, and the health port on by default.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncgraph.distributed import WorkerConfig

__all__ = ["DEFAULT_IMPORTS", "load"]

# The text Functions (LLM calls, losses, feedback), the demo's, and the example.
DEFAULT_IMPORTS = ("asyncgraph.text", "asyncgraph.jobs.demo", "workers.functions")
DEFAULT_HEALTH_PORT = 9100


def load(env: Mapping[str, str]) -> WorkerConfig:
    """The service's configuration from ``env``; ``ValueError`` names a wrong variable."""
    if not env.get("ASYNCGRAPH_REDIS_URL", "").strip():
        raise ValueError("ASYNCGRAPH_REDIS_URL is required (e.g. redis://redis:6379/0)")
    return WorkerConfig.from_env(env, imports=DEFAULT_IMPORTS, health_port=DEFAULT_HEALTH_PORT)
