"""``python -m workers [--check]``: run the worker service configured by the environment.

``--check`` validates every setting (``workers/settings.py``), imports the function
modules, builds the worker's configuration, prints what would be served, and exits
(0 when all is valid, 2 otherwise): a build-time or pre-deploy check. It does not
connect to Redis.
"""

from __future__ import annotations

import argparse
import os
import sys

from workers.settings import Settings


def check(settings: Settings) -> str:
    """Everything ``asyncgraph worker`` would check before serving; a summary, or ``ValueError``."""
    from asyncgraph.distributed.wire._codec import Limits
    from asyncgraph.distributed.worker import WorkerConfig, build_registry

    try:
        registry = build_registry(settings.imports)
    except ImportError as exc:
        raise ValueError(f"ASYNCGRAPH_IMPORTS: cannot import {exc.name or exc}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"ASYNCGRAPH_IMPORTS: {exc}") from None
    WorkerConfig(
        redis_url=settings.redis_url,
        queue=settings.queue,
        concurrency=settings.concurrency,
        secret=settings.secret,
        lease_ms=settings.lease_ms,
        max_attempts=settings.max_attempts,
        drain_timeout_s=settings.drain_timeout_s,
        health_port=settings.health_port,
        allowed_base_urls=settings.allowed_base_urls,
        connect_timeout_s=settings.connect_timeout_s,
        limits=Limits(),
    )
    return (
        f"queue {settings.queue!r}: serving {', '.join(sorted(registry))} "
        f"({settings.processes} process(es) x {settings.concurrency}, "
        f"{'signed' if settings.secret else 'unsigned'}, health port "
        f"{settings.health_port if settings.health_port is not None else 'off'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="validate settings and imports, then exit"
    )
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(os.environ)
        summary = check(settings) if args.check else ""
    except ValueError as exc:
        print(f"workers: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(summary)
        return 0
    from asyncgraph.cli import main as cli_main

    # `asyncgraph worker` reads the URL, the secret and the allowed base URLs from the
    # environment (not from argv, which other users can read): give it the checked values.
    os.environ["ASYNCGRAPH_REDIS_URL"] = settings.redis_url
    return cli_main(["worker", *settings.argv()])


if __name__ == "__main__":
    sys.exit(main())
