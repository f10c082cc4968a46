from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The fast tier (`pytest -m "not slow"`) leaves these out: tests with a real redis-server,
# worker processes or other subprocesses (CLI runs, README snippets, builds, a browser).
SLOW_PATHS = (
    "tests/distributed/",
    "tests/resp/",
    "tests/jobs/test_jobs_demo.py",
    "tests/jobs/test_jobs_fleet.py",
    "tests/jobs/test_jobs_module.py",
    "tests/jobs/test_jobs_record.py",
    "tests/jobs/test_jobs_run_cli.py",
    "tests/jobs/test_jobs_sigint.py",
    "tests/jobs/test_jobs_ui.py",
    "tests/text/test_text_distributed.py",
    "tests/text/test_text_program.py",
    "tests/test_cli.py",
    "tests/test_packaging.py",
    "tests/test_readme.py",
)
SLOW_FIXTURES = {"redis_url", "redis_server_url"}


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


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """URL of a real Redis: ``REDIS_URL`` if set, else a redis-server we start."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    from asyncgraph.distributed._redis_server import RedisServer

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
