"""The ``asyncgraph`` command.

Subcommands live next to what they drive and register themselves here:
``worker`` (asyncgraph.distributed.worker), ``demo``, ``run``, ``eval`` and ``ui``
(asyncgraph.jobs).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

__all__ = ["main"]

# Layers whose policies the fleet must apply, installed as task hooks on import: the
# worker serves whatever its --import modules hold, and the model policy (base-URL
# allowlist, usage sent back) must apply even when none of them imports it.
POLICY_LAYERS: dict[str, tuple[str, ...]] = {"worker": ("asyncgraph.models",)}

# name -> (module, help). Each module defines ``add_arguments(parser)`` and
# ``run(args) -> int``; only the module of the subcommand being run is imported.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("asyncgraph.distributed.worker._cli", "serve remote backwards from a Redis queue"),
    "demo": ("asyncgraph.jobs._demo_cli", "run the shipped prompt-optimization demo"),
    "run": ("asyncgraph.jobs._run_cli", "run a job file"),
    "eval": (
        "asyncgraph.jobs._eval_cli",
        "score a job file's parameters (e.g. --params best.json) on one of its splits",
    ),
    "status": ("asyncgraph.distributed._status", "show a fleet: workers, queue, dead letters"),
    "ui": ("asyncgraph.jobs._ui", "a local web dashboard of job runs (live while they run)"),
}


def _worker_tracing() -> None:
    """Export a worker's spans when OpenTelemetry's variables ask for it (and it is installed)."""
    import os

    if not any(
        os.environ.get(name)
        for name in (
            "ASYNCGRAPH_OTEL",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        )
    ):
        return
    try:
        otel = importlib.import_module("asyncgraph.observe.otel")
    except ImportError as exc:
        print(f"asyncgraph worker: tracing asked for but not available: {exc}", file=sys.stderr)
        return
    otel.setup_worker_from_env()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncgraph")
    except PackageNotFoundError:  # a source checkout that was never installed
        from asyncgraph import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is one line (what was wrong, where the usage is)
    instead of the whole usage block before it; the exit code stays 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``asyncgraph`` parser; only ``command``'s module is imported (for its options)."""
    parser = _Parser(
        prog="asyncgraph", description="Async autodiff for slow functions (textual gradients)."
    )
    parser.add_argument(
        "--version", action="version", version=f"asyncgraph {_version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=functools.partial(_run, name, module), _parser=sub_parser)
    return parser


def _run(name: str, module: ModuleType, args: argparse.Namespace) -> int:
    """Run subcommand ``name``: what it needs beyond its options loads now, not for --help
    or a usage error (the policy layers of a worker, its tracing)."""
    for layer in POLICY_LAYERS.get(name, ()):
        importlib.import_module(layer)
    if name == "worker":
        _worker_tracing()
    return int(module.run(args))


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args, extras = parser.parse_known_args(args_list)
    if extras:
        # A bad flag after a subcommand gets that subcommand's usage, not the top level's.
        owner = getattr(args, "_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
