"""The fast tier (``pytest -m "not slow"``) is chosen by fixture, not by folder: a test that
uses a fixture starting a redis-server or workers is slow, a pure one is not, and a test
left in the fast tier that starts a process fails saying so (tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest


def _uses_redis(redis_url: str) -> None:  # collected below, never run
    raise AssertionError


def _uses_workers(shared_fleet: str) -> None:
    raise AssertionError


def _pure(tmp_path: Path) -> None:
    raise AssertionError


def _conftest(request: pytest.FixtureRequest) -> ModuleType:
    plugin = request.config.pluginmanager.get_plugin(str(Path(__file__).parent / "conftest.py"))
    assert isinstance(plugin, ModuleType)
    return plugin


def test_a_test_using_a_redis_fixture_is_slow_and_a_pure_one_is_not(
    request: pytest.FixtureRequest,
) -> None:
    module = request.node.parent
    items = [
        pytest.Function.from_parent(module, name=f.__name__, callobj=f)
        for f in (_uses_redis, _uses_workers, _pure)
    ]
    # The conftest's hook alone: `-m "not slow"` would deselect from the list too.
    _conftest(request).pytest_collection_modifyitems(request.config, items)
    slow = [item.name for item in items if item.get_closest_marker("slow") is not None]
    assert slow == ["_uses_redis", "_uses_workers"]


def test_a_redis_test_of_the_suite_is_slow_and_this_one_is_not(
    request: pytest.FixtureRequest,
) -> None:
    assert request.node.get_closest_marker("slow") is None
    conftest = _conftest(request)
    assert {"redis_url", "redis_server_url", "redis_server_binary"} <= conftest.SLOW_FIXTURES


def test_a_process_started_by_a_test_of_the_fast_tier_is_recorded(
    request: pytest.FixtureRequest,
) -> None:
    spawns = _conftest(request)._fast_test_spawns
    assert spawns == []  # this test is in the fast tier: its starts are being recorded
    # The audit event subprocess.Popen raises, without starting anything.
    sys.audit("subprocess.Popen", "/bin/probe", ["/bin/probe", "--flag"], None, None)
    assert spawns == ["subprocess.Popen('/bin/probe', ['/bin/probe', '--flag'])"]
    spawns.clear()  # or the guard fails this test when it returns
