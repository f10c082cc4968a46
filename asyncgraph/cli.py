"""The ``asyncgraph`` command.

Subcommands live next to what they drive and register themselves here:
``worker`` (asyncgraph.worker), ``demo`` and ``run`` (asyncgraph.jobs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> (module, help). Each module defines ``add_arguments(parser)`` and
# ``run(args) -> int``; imported only when its subcommand is used.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("asyncgraph.worker._cli", "serve remote backwards from a Redis queue"),
    "demo": ("asyncgraph.jobs._demo_cli", "run the shipped prompt-optimization demo"),
    "run": ("asyncgraph.jobs._run_cli", "run a job file"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgraph", description="Async autodiff for slow functions (textual gradients)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not exc.name or not module_name.startswith(exc.name):
                raise
            continue  # subcommand not built in this version
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
