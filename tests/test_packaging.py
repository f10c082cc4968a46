"""The package as a user gets it: a wheel that installs into a fresh venv and runs the demo."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_py_typed_and_license_ship_with_the_source() -> None:
    assert (ROOT / "asyncgraph" / "py.typed").is_file()
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "CHANGELOG.md").is_file()


def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = dist.glob("asyncgraph-*.whl")
    # Without the checkout on the path: only the wheel counts (a source tree's egg-info on
    # PYTHONPATH would make pip think asyncgraph is already installed).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=240,
        env=env,
    )
    work = tmp_path / "cwd"
    work.mkdir()
    version = subprocess.run(
        [str(env_dir / "bin" / "asyncgraph"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work,
        env=env,
    )
    assert version.returncode == 0 and version.stdout.startswith("asyncgraph "), version
    demo = subprocess.run(
        [str(env_dir / "bin" / "asyncgraph"), "demo", "--latency-ms", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=work,
        env=env,
    )
    assert demo.returncode == 0, demo.stderr
    assert "validation accuracy" in demo.stdout
    assert "100%" in demo.stdout
    typed = subprocess.run(
        [
            str(python),
            "-c",
            "import asyncgraph, pathlib; "
            "print((pathlib.Path(asyncgraph.__file__).parent / 'py.typed').is_file())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work,
        env=env,
    )
    assert typed.stdout.strip() == "True"
