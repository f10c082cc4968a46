"""``python -m workers [--check]``: run the worker service configured by the environment.

``--check`` imports the function modules, prints what would be served, and exits
(0 when the configuration is valid): a build-time or readiness check.
"""

from __future__ import annotations

import argparse
import os
import sys

from workers.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--check", action="store_true", help="validate settings and imports, then exit")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(os.environ)
    except ValueError as exc:
        print(f"workers: {exc}", file=sys.stderr)
        return 2
    if args.check:
        from asyncgraph.worker import build_registry

        try:
            registry = build_registry(settings.imports)
        except (ImportError, ValueError) as exc:
            print(f"workers: {exc}", file=sys.stderr)
            return 2
        print(f"queue {settings.queue!r}: serving {', '.join(sorted(registry))}")
        return 0
    from asyncgraph.cli import main as cli_main

    return cli_main(["worker", *settings.argv()])


if __name__ == "__main__":
    sys.exit(main())
