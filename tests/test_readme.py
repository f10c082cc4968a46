"""The README's first Python example runs and does what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_core_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README has no python example"
    done = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "be calmer (given: no feedback yet)" in done.stdout


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
