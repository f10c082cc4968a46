"""The ``asyncgraph`` command: subcommands listed, and only the one being run is imported."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from asyncgraph.cli import SUBCOMMANDS

pytestmark = pytest.mark.slow  # every test runs the command in a subprocess


def run(*code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "\n".join(code)], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_subcommand() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    for name in ("worker", "demo", "run"):
        assert name in done.stdout


def test_a_subcommand_imports_only_its_own_module() -> None:
    done = run(
        "import sys",
        "from asyncgraph.cli import build_parser",
        "build_parser('worker').parse_args(['worker', '--help'])",
    )
    assert done.returncode == 0, done.stderr  # argparse exits 0 after --help
    check = run(
        "import sys",
        "from asyncgraph.cli import build_parser",
        "build_parser('worker')",
        "print(sorted(m for m in sys.modules if m.startswith('asyncgraph.jobs')))",
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "[]"


def test_no_command_prints_help_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncgraph"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "COMMAND" in done.stdout


def test_version_prints_the_installed_version() -> None:
    import asyncgraph

    done = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"asyncgraph {asyncgraph.__version__}"


def test_a_bad_flag_after_a_subcommand_is_one_line_naming_that_subcommands_help() -> None:
    for argv, usage in (
        (["demo", "--bogus"], "asyncgraph demo: error: "),
        (["run", "job.py", "--bogus"], "asyncgraph run: error: "),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "asyncgraph", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert done.stderr.startswith(usage), done.stderr
        assert "unrecognized arguments: --bogus" in done.stderr
        command = usage.split(":")[0]
        assert done.stderr.count("\n") == 1 and f"(see '{command} --help')" in done.stderr


def test_worker_log_level_is_checked_and_documented() -> None:
    import os

    for argv, env, named in (
        (["worker", "--log-level", "LOUD"], {}, "asyncgraph worker: error: argument --log-level"),
        (
            ["worker", "--import", "asyncgraph.text"],
            {"ASYNCGRAPH_LOG_LEVEL": "LOUD"},
            "asyncgraph worker: ASYNCGRAPH_LOG_LEVEL must be one of",
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "asyncgraph", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert done.returncode == 2
        assert named in done.stderr
        assert "must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'" in done.stderr
        assert "Traceback" not in done.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--log-level LEVEL" in helped.stdout and "DEBUG, INFO, WARNING" in helped.stdout


# What answering --help or a usage error may not load (#35): the clients of a model or a
# fleet load when one is first used, not to print a usage.
NOT_FOR_A_USAGE = ("httpx", "redis", "hiredis", "msgpack", "numpy", "rich", "asyncgraph.resp")


def _loaded_answering(argv: list[str]) -> tuple[int, list[str]]:
    """Run ``asyncgraph *argv`` in a fresh process: its exit code, and which of
    ``NOT_FOR_A_USAGE`` it had loaded when it exited."""
    done = run(
        "import sys",
        "from asyncgraph.cli import main",
        "try:",
        f"    code = main({argv!r})",
        "except SystemExit as exc:",
        "    code = exc.code",
        f"names = {NOT_FOR_A_USAGE!r}",
        "print(code)",
        "print(sorted(n for n in names if any(m == n or m.startswith(n + '.') for m in sys.modules)))",
    )
    assert done.stdout, done.stderr
    code, loaded = done.stdout.splitlines()[-2:]
    return int(code), ast.literal_eval(loaded)


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_a_subcommands_help_and_usage_error_load_no_client(sub: str) -> None:
    assert _loaded_answering([sub, "--help"]) == (0, [])
    assert _loaded_answering([sub, "--no-such-flag"]) == (2, [])
