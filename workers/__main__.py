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

from asyncgraph.distributed import WorkerConfig
from workers.settings import load


def check(config: WorkerConfig) -> str:
    """Everything ``asyncgraph worker`` would check before serving; a summary, or ``ValueError``."""
    from asyncgraph.distributed import build_registry

    try:
        registry = build_registry(config.imports)
    except ImportError as exc:
        raise ValueError(f"ASYNCGRAPH_IMPORTS: cannot import {exc.name or exc}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"ASYNCGRAPH_IMPORTS: {exc}") from None
    return (
        f"queue {config.queue!r}: serving {', '.join(sorted(registry))} "
        f"({config.processes} process(es) x {config.concurrency}, "
        f"{'signed' if config.secret else 'unsigned'}, health port "
        f"{config.health_port if config.health_port is not None else 'off'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="validate settings and imports, then exit"
    )
    args = parser.parse_args(argv)
    try:
        config = load(os.environ)
        summary = check(config) if args.check else ""
    except ValueError as exc:
        print(f"workers: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(summary)
        return 0
    from asyncgraph.cli import main as cli_main

    # The same configuration as flags (the URL, the secret and the allowed base URLs stay
    # in the environment, not in argv, which other users can read).
    os.environ.update(config.to_env())
    return cli_main(["worker", *config.to_args()])


if __name__ == "__main__":
    sys.exit(main())
