"""The deployable service in workers/: settings from the environment, ``python -m workers``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workers.settings import Settings  # noqa: E402


def test_settings_from_environment() -> None:
    settings = Settings.from_env({
        "ASYNCGRAPH_REDIS_URL": "rediss://u:p@redis:6380/1",
        "ASYNCGRAPH_IMPORTS": "a.b, c",
        "ASYNCGRAPH_PROCESSES": "4",
        "ASYNCGRAPH_HEALTH_PORT": "",
        "ASYNCGRAPH_SECRET": "x" * 32,
    })
    assert settings.imports == ("a.b", "c") and settings.processes == 4
    argv = settings.argv()
    assert "--health-port" not in argv and "x" * 32 not in argv  # the secret stays in the env
    assert argv[argv.index("--import") + 1] == "a.b"


@pytest.mark.parametrize(
    ("env", "message"),
    [({}, "ASYNCGRAPH_REDIS_URL is required"),
     ({"ASYNCGRAPH_REDIS_URL": "redis://r", "ASYNCGRAPH_CONCURRENCY": "many"}, "CONCURRENCY"),
     ({"ASYNCGRAPH_REDIS_URL": "redis://r", "ASYNCGRAPH_BACKEND": "curio"}, "BACKEND")],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_env(env)


def test_python_m_workers_check_lists_the_default_functions() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCGRAPH_")}
    env["ASYNCGRAPH_REDIS_URL"] = "redis://127.0.0.1:1/0"
    result = subprocess.run([sys.executable, "-m", "workers", "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "workers.echo" in result.stdout
