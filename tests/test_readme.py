"""The README's examples run and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@pytest.mark.slow
def test_readme_core_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    core = [b for b in blocks if "be calmer" in b]
    assert core, "README has no core example"
    done = subprocess.run(
        [sys.executable, "-c", core[0]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "be calmer (given: no feedback yet)" in done.stdout


@pytest.mark.slow
def test_readme_demo_output_is_what_the_demo_prints() -> None:
    text = README.read_text()
    block = re.search(r"<!-- demo-output -->\n```\n(.*?)```", text, re.DOTALL)
    assert block is not None
    done = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "demo"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr

    def stable(output: str) -> list[str]:
        # Wall time and the speedup derived from it vary from run to run.
        return [
            line.rstrip()
            for line in output.splitlines()
            if not line.startswith(("steps: ", "one call at a time"))
        ]

    assert stable(done.stdout) == stable(block.group(1))


# Python blocks marked ``<!-- readme-test: NAME -->`` run as written, each in a fresh
# process in an empty directory; when a ```text block follows (after "prints:"), the
# output must be exactly that.
SNIPPET = re.compile(
    r"<!-- readme-test: (\S+) -->\n```python\n(.*?)```\n(?:\nprints:\n\n```text\n(.*?)```)?",
    re.DOTALL,
)


def _snippets() -> list[tuple[str, str, str | None]]:
    return SNIPPET.findall(README.read_text())


def test_the_readme_has_runnable_snippets() -> None:
    names = [name for name, _, _ in _snippets()]
    assert len(names) == len(set(names)), names
    assert {"first"} <= set(names)


def test_the_readme_is_a_front_door_not_the_manual() -> None:
    # What it is, the install, one example, the demo, links: the manual is docs/.
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert text.count("```python") <= 3


def test_every_relative_link_of_the_readme_reaches_a_file_and_its_anchor() -> None:
    root = README.parent
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = root / path
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), re.MULTILINE)
            slugs = {
                re.sub(r"[^a-z0-9 _-]", "", h.lower()).strip().replace(" ", "-") for h in headings
            }
            if anchor not in slugs:
                broken.append(target)
    assert broken == []


@pytest.mark.parametrize("name", [name for name, _, _ in _snippets()])
@pytest.mark.slow
def test_readme_snippet_runs_as_written(name: str, tmp_path: Path) -> None:
    (code, expected) = next((c, e) for n, c, e in _snippets() if n == name)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if expected:
        assert done.stdout == expected


def test_every_python_block_runs_in_the_suite_or_says_it_is_a_fragment() -> None:
    text = README.read_text()
    for match in re.finditer(r"```python\n", text):
        if "be calmer" in text[match.start() : text.index("```\n", match.end())]:
            continue  # test_readme_core_example_runs
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        assert before.startswith(("<!-- readme-test:", "<!-- fragment:")), (
            f"README line {text[: match.start()].count(chr(10)) + 1}: a python block that "
            f"no test runs; add <!-- readme-test: NAME --> or <!-- fragment: why -->"
        )


def test_ci_runs_the_readme_test_command() -> None:
    # The README's two commands (set up, then test) are what CI runs on a fresh machine.
    readme = (ROOT / "README.md").read_text()
    setup, test = 'python3 -m pip install -e ".[test]"', "python3 -m pytest -n auto"
    assert f"```\n{setup}\n{test}\n```" in readme
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert setup in ci and test in ci
    contributing = (ROOT / "docs" / "contributing.md").read_text()
    assert f"```bash\n{setup}\n{test}\n```" in contributing
