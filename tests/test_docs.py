"""The documentation site: its tutorials run as written, its CLI pages list every flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPET = re.compile(
    r"<!-- docs-test: (\S+) -->\n```python\n(.*?)```\n(?:\n(?:`python job.py` )?prints:\n\n```text\n(.*?)```)?",
    re.DOTALL,
)


def snippets() -> dict[str, tuple[str, str | None]]:
    found: dict[str, tuple[str, str | None]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for name, code, expected in SNIPPET.findall(page.read_text()):
            assert name not in found, f"snippet name {name!r} is used twice"
            found[name] = (code, expected or None)
    return found


def run(
    code: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})},
        check=False,
    )


def test_every_python_block_of_a_tutorial_is_tested() -> None:
    for page in (DOCS / "tutorials").glob("*.md"):
        text = page.read_text()
        assert text.count("```python") == len(SNIPPET.findall(text)), page.name


@pytest.mark.parametrize("name", ["tutorial-job", "function-sync", "function-async"])
@pytest.mark.slow
def test_a_local_tutorial_runs_as_written(name: str, tmp_path: Path) -> None:
    code, expected = snippets()[name]
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


@pytest.mark.slow
def test_the_tutorial_job_runs_from_the_command_line_as_the_tutorial_says(tmp_path: Path) -> None:
    # "From the command line": the same file, run and evaluated by the CLI, which
    # imports it and calls build_job() (no main(): the model must be set at import).
    code, _ = snippets()["tutorial-job"]
    (tmp_path / "job.py").write_text(code)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "asyncgraph", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
            check=False,
        )

    done = cli("run", "job.py", "--out", "runs/even-odd")
    assert done.returncode == 0, done.stderr
    assert "finished after 4 step(s)" in done.stdout
    assert "prompt: Label the number. Even numbers are 'even'. Odd numbers are 'odd'." in (
        done.stdout
    )
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    done = cli("eval", "job.py", "--params", "runs/even-odd/best.json")
    assert done.returncode == 0, done.stderr
    assert "score: 1.0000" in done.stdout


def test_the_fleet_tutorial_runs_against_real_workers(
    tmp_path: Path, redis_server_binary: None
) -> None:
    from asyncgraph.distributed import RedisServer, wait_for_workers

    functions, _ = snippets()["fleet-functions"]
    client, expected = snippets()["fleet-client"]
    (tmp_path / "myfunctions.py").write_text(functions)
    with RedisServer() as server:
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "ASYNCGRAPH_REDIS_URL": server.url}
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "asyncgraph", "worker", "--import", "myfunctions"),
                *("--processes", "2", "--concurrency", "64", "--log-level", "WARNING"),
            ],
            cwd=tmp_path,
            env=env,
        )
        try:
            wait_for_workers(server.url, "grads", 2, proc=worker)
            done = run(client, tmp_path, {"ASYNCGRAPH_REDIS_URL": server.url})
        finally:
            worker.terminate()
            worker.wait(30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


CLI = ["demo", "run", "eval", "worker", "status", "ui"]


@pytest.mark.parametrize("command", CLI)
def test_each_command_has_a_page_listing_all_its_flags(command: str) -> None:
    from asyncgraph.cli import build_parser

    page = (DOCS / "cli" / f"{command}.md").read_text()
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[
        command
    ]
    for action in sub._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help" and action.help != "==SUPPRESS==":
                assert f"`{flag}" in page, f"docs/cli/{command}.md does not mention {flag}"
