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
