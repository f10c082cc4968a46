from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
