"""Replies Redis sent that never arrived (issue #23 point 8): what the client sends again."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agdist_functions as F
import pytest
import redis
from agdist_helpers import StartWorker, wait_until

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.resp import parse_redis_url

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.fixture
def proxy(redis_url: str) -> Iterator[Any]:
    """A proxy to the suite's Redis that can lose a reply (tests/resp/blackhole.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resp"))
    from blackhole import BlackholeProxy

    address = parse_redis_url(redis_url)
    proxy = BlackholeProxy(address.host, address.port)
    yield proxy
    proxy.close()


def runs(url: str, tag: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.llen(f"agdist:finished:{tag}"))
    finally:
        client.close()


async def test_tasks_whose_send_lost_its_reply_are_sent_again_and_run_once(
    redis_url: str, proxy: Any, start_worker: StartWorker
) -> None:
    """The channel sends tasks with ``retry=True``: the batch XADDed, its reply lost, it
    goes again; of the task's two entries the first runs and the second is dead-lettered
    ``replayed`` (NOTE [Replays] in ``worker._admission``): run once, counted once."""
    start_worker(redis_url, "lost")
    x = Parameter(2.0, role="x")
    url = f"redis://127.0.0.1:{proxy.port}/0"
    client = redis.Redis.from_url(redis_url)
    async with open_redis_executor(url, queue="lost", timeout_s=30) as ex:
        await backward(F.Sleep.apply(x, 0.0, "warm"), executor=ex)  # pooled connections
        before = proxy.accepted
        proxy.drop_next_reply(after=b"XADD")
        x.grad = None
        await backward(F.Sleep.apply(F.Scale.apply(x, 3.0), 0.2, "lost"), executor=ex)
        assert proxy.accepted > before  # the send went again, on a new connection
        dead = keys.dead_stream("lost")
        await wait_until(lambda: [f[keys.F_REASON] for _, f in client.xrange(dead)] != [])
        assert [f[keys.F_REASON] for _, f in client.xrange(dead)] == [b"replayed"]
        assert ex.stats.completed == 3  # the warm-up, the Sleep and the Scale: each once
    client.close()
    assert runs(redis_url, "lost") == 1
    assert x.grad is not None and x.grad.data == 3.0
