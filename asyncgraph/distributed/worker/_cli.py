"""``asyncgraph worker``: serve remote backwards from a Redis queue.

    asyncgraph worker --redis redis://127.0.0.1:6379/0 --queue grads \\
        --import myapp.functions --concurrency 64 [--processes 4] [--health-port 9100]

Every flag has an ``ASYNCGRAPH_*`` variable (``--lease-ms``: ``ASYNCGRAPH_LEASE_MS``),
used when the flag is left out: see ``_config.SETTINGS``. The Redis URL, the secret
and the allowed base URLs are best given that way; that is how ``--processes N``
hands them to its children.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import logging
import os
import sys

import anyio

from asyncgraph._exceptions import ConfigError, RedisConnectionLost
from asyncgraph._redact import RedactingFormatter, url_secrets
from asyncgraph.distributed.worker._config import WorkerConfig, add_arguments, log_level

__all__ = ["add_arguments", "log_level", "run"]

log = logging.getLogger("asyncgraph.distributed.worker")


def run(args: argparse.Namespace) -> int:
    try:
        config = WorkerConfig.from_args(args)
    except ValueError as exc:
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        return 2
    # Every line redacted as it is written: a log line may quote a URL or an error text.
    handler = logging.StreamHandler()
    handler.setFormatter(
        RedactingFormatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s",
            secrets=[s for s in (config.secret, *url_secrets(config.redis_url)) if s],
        )
    )
    logging.basicConfig(level=config.log_level, handlers=[handler])
    if not config.imports:
        print(
            "asyncgraph worker: give at least one --import MODULE (the functions to serve)",
            file=sys.stderr,
        )
        return 2
    from asyncgraph.distributed.worker._registry import build_registry
    from asyncgraph.distributed.worker._worker import EXIT_REPLACE, Worker

    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory
    try:
        # Checked here also under --processes: a broken setting fails once, not in a restart loop.
        registry = build_registry(config.imports)
        worker = Worker(config, registry)
    except (ImportError, ValueError) as exc:
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        return 2
    if config.processes > 1:
        return _supervise(config)
    log.info(
        "worker %s serving %s on queue %r (concurrency %d, %s)",
        worker.consumer,
        ", ".join(sorted(registry)),
        config.queue,
        config.concurrency,
        "signed" if config.secret else "unsigned",
    )
    # What start-up made (modules, the registry) lives as long as the process: moved out
    # of the collector's sight, full collections walk only what tasks leave behind.
    gc.freeze()
    code = 0
    try:
        anyio.run(functools.partial(worker.serve, handle_signals=True), backend=config.backend)
    except KeyboardInterrupt:
        code = 130
    except RedisConnectionLost as exc:
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        code = 1
    except ConfigError as exc:  # e.g. its Redis user cannot write the call journal
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        code = 2
    if worker.needs_replacing:  # drained for too many abandoned calls: ask to be replaced
        code = EXIT_REPLACE
    if worker.abandoned:
        # Python cannot stop a thread, and would wait for these at exit: past the drain
        # deadline their tasks were handed back to other workers, so exit now.
        log.warning(
            "worker %s: exiting with %d abandoned synchronous call(s) still running",
            worker.consumer,
            worker.abandoned,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _supervise(config: WorkerConfig) -> int:
    from asyncgraph.distributed.worker._supervisor import Supervisor, child_command

    # Each child is one process of this configuration; the health endpoint is the
    # supervisor's. The Redis URL (it may carry a password) and the secret go through the
    # environment: a command line is visible to every user of the machine.
    child = dataclasses.replace(config, processes=1, health_port=None, consumer=None)
    supervisor = Supervisor(
        [*child_command(), *child.to_args()],
        config.processes,
        env=config.child_env(),
        drain_timeout_s=config.drain_timeout_s,
        health_host=config.health_host,
        health_port=config.health_port,
    )
    try:
        return anyio.run(supervisor.run)
    except KeyboardInterrupt:
        return 130
