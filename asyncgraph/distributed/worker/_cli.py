"""``asyncgraph worker``: serve remote backwards from a Redis queue.

    asyncgraph worker --redis redis://127.0.0.1:6379/0 --queue grads \\
        --import myapp.functions --concurrency 64 [--processes 4] [--health-port 9100]

The Redis URL, the secret and the allowed base URLs can come from the environment
(``ASYNCGRAPH_REDIS_URL``, ``ASYNCGRAPH_SECRET``, ``ASYNCGRAPH_ALLOWED_BASE_URLS``);
that is how ``--processes N`` hands them to its children.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import anyio

from asyncgraph.distributed.wire._codec import Limits
from asyncgraph.distributed.wire._signing import SECRET_ENV, secret_from_env
from asyncgraph.models import ENV_ALLOWED_BASE_URLS
from asyncgraph.resp import RedisConnectionLost

__all__ = ["add_arguments", "allowed_base_urls_from_env", "run"]

REDIS_URL_ENV = "ASYNCGRAPH_REDIS_URL"

log = logging.getLogger("asyncgraph.distributed.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--redis",
        default=env(REDIS_URL_ENV, "redis://127.0.0.1:6379/0"),
        metavar="URL",
        help="Redis URL: redis://, rediss:// (TLS), "
        "user:password@ for ACLs (default: $ASYNCGRAPH_REDIS_URL or %(default)s)",
    )
    parser.add_argument(
        "--queue",
        default=env("ASYNCGRAPH_QUEUE", "grads"),
        help="queue name (default: %(default)s)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="module whose Functions with dispatch='remote' this worker serves "
        "(repeatable; at least one)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="tasks one process runs at once (default: %(default)s)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="worker processes to run and supervise (default: %(default)s)",
    )
    parser.add_argument(
        "--secret",
        default=None,
        help=f"shared HMAC secret (prefer ${SECRET_ENV}: argv is visible to other users)",
    )
    parser.add_argument(
        "--lease-ms",
        type=int,
        default=10_000,
        help="a task held this long without renewal is reclaimed by another "
        "worker (default: %(default)s)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="deliveries before a task that never completes is dead-lettered "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="tasks read per XREADGROUP at most (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long held tasks may finish (default: %(default)s)",
    )
    parser.add_argument(
        "--redis-timeout-s",
        type=float,
        default=5.0,
        help="deadline of each Redis call (default: %(default)s)",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="serve /healthz and /metrics on this port (0: any free port)",
    )
    parser.add_argument(
        "--health-host",
        default="0.0.0.0",
        help="address of the health endpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--allow-base-url",
        dest="allowed_base_urls",
        action="append",
        default=[],
        metavar="URL",
        help="a model base URL tasks may name (repeatable; also "
        f"${ENV_ALLOWED_BASE_URLS}, comma-separated): the worker sends its own "
        "API key there. The default OpenAI URL (and $OPENAI_BASE_URL) is always "
        "allowed; any other base URL in a task fails that task",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=0.0,
        help="at start, how long to retry connecting to Redis (default: 0, "
        "forever; health answers 503 meanwhile)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=Limits().max_message_bytes,
        help="largest message accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="event loop that runs async backwards (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=env("ASYNCGRAPH_LOG_LEVEL", "INFO"),
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: ASYNCGRAPH_LOG_LEVEL or INFO); "
        "INFO shows reclaims and dead letters, DEBUG every task",
    )
    # Set by the supervisor for its children.
    parser.add_argument("--metrics-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor-pid", type=int, default=None, help=argparse.SUPPRESS)


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """argparse type: a logging level name, any case (argparse applies it to the
    environment default too, so a bad ASYNCGRAPH_LOG_LEVEL is a usage error as well)."""
    level = str(text).strip().upper()
    if level not in _LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_LEVELS)}, got {text!r}")
    return level


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.imports:
        print(
            "asyncgraph worker: give at least one --import MODULE (the functions to serve)",
            file=sys.stderr,
        )
        return 2
    if args.processes < 1:
        print(f"asyncgraph worker: --processes must be >= 1, got {args.processes}", file=sys.stderr)
        return 2
    secret = args.secret or secret_from_env()
    allowed = tuple(dict.fromkeys([*args.allowed_base_urls, *allowed_base_urls_from_env()]))
    from asyncgraph.distributed.worker._registry import build_registry
    from asyncgraph.distributed.worker._worker import Worker, WorkerConfig

    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory
    try:
        # Checked here also under --processes: a broken setting fails once, not in a restart loop.
        registry = build_registry(args.imports)
        config = WorkerConfig(
            redis_url=args.redis,
            queue=args.queue,
            concurrency=args.concurrency,
            secret=secret,
            lease_ms=args.lease_ms,
            max_attempts=args.max_attempts,
            batch_size=args.batch_size,
            redis_timeout_s=args.redis_timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            health_host=args.health_host,
            health_port=args.health_port,
            metrics_dir=args.metrics_dir,
            supervisor_pid=args.supervisor_pid,
            limits=Limits(max_message_bytes=args.max_message_bytes),
            allowed_base_urls=allowed,
            connect_timeout_s=args.connect_timeout_s,
        )
        worker = Worker(config, registry)
    except (ImportError, ValueError) as exc:
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        return 2
    if args.processes > 1:
        return _supervise(args, secret, allowed)
    log.info(
        "worker %s serving %s on queue %r (concurrency %d, %s)",
        worker.consumer,
        ", ".join(sorted(registry)),
        config.queue,
        config.concurrency,
        "signed" if secret else "unsigned",
    )
    try:
        anyio.run(_serve, worker, backend=args.backend)
    except KeyboardInterrupt:
        return 130
    except RedisConnectionLost as exc:
        print(f"asyncgraph worker: {exc}", file=sys.stderr)
        return 1
    return 0


def allowed_base_urls_from_env() -> list[str]:
    """The URLs in ``ASYNCGRAPH_ALLOWED_BASE_URLS`` (comma-separated)."""
    return [u.strip() for u in os.environ.get(ENV_ALLOWED_BASE_URLS, "").split(",") if u.strip()]


async def _serve(worker: Any) -> None:
    await worker.serve(handle_signals=True)


def _supervise(args: argparse.Namespace, secret: str | None, allowed: tuple[str, ...]) -> int:
    from asyncgraph.distributed.worker._supervisor import Supervisor, child_command

    # The Redis URL (it may carry a password) and the secret go through the environment:
    # a command line is visible to every user of the machine (ps, /proc/<pid>/cmdline).
    argv = [
        *child_command(),
        "--queue",
        args.queue,
        "--concurrency",
        str(args.concurrency),
        "--lease-ms",
        str(args.lease_ms),
        "--max-attempts",
        str(args.max_attempts),
        "--batch-size",
        str(args.batch_size),
        "--drain-timeout-s",
        str(args.drain_timeout_s),
        "--redis-timeout-s",
        str(args.redis_timeout_s),
        "--max-message-bytes",
        str(args.max_message_bytes),
        "--connect-timeout-s",
        str(args.connect_timeout_s),
        "--backend",
        args.backend,
        "--log-level",
        args.log_level,
    ]
    for module in args.imports:
        argv += ["--import", module]
    env = dict(os.environ)
    env[REDIS_URL_ENV] = args.redis
    if secret:
        env[SECRET_ENV] = secret
    env[ENV_ALLOWED_BASE_URLS] = ",".join(allowed)
    supervisor = Supervisor(
        argv,
        args.processes,
        env=env,
        drain_timeout_s=args.drain_timeout_s,
        health_host=args.health_host,
        health_port=args.health_port,
    )
    try:
        return anyio.run(supervisor.run)
    except KeyboardInterrupt:
        return 130
