"""Replies Redis sent that never arrived (issue #23 point 8): what the client sends again;
and replies a client could not read for a while (issue #39): they wait for it."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, wait_until

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.resp import parse_redis_url

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


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
        # Connections to spare in the pool: the send finds one there even while the
        # heartbeat holds another (a send on a new connection is never sent again: a new
        # connection that fails says Redis is gone; the pool's docstring).
        async with ex._pool.connection(), ex._pool.connection(), ex._pool.connection():
            pass  # three held at once, then all three back in the pool
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


@pytest.mark.parametrize("stall_s", [1.0, 3.0, 6.0])
async def test_a_client_whose_connection_stalls_while_its_tasks_finish_gets_their_results(
    redis_url: str, proxy: Any, start_worker: StartWorker, stall_s: float
) -> None:
    """Issue #39: only the client's connection stalls (the proxy forwards nothing either way),
    for less than its heartbeat, and for longer (its key lapses, workers take it for dead).
    Its six tasks finish meanwhile; their replies wait in its reply stream, which lives as
    long as the client's deadline (60 s), not 2 s: once the connection moves again the pass
    completes, nothing sent again, each task run once."""
    queue = f"stall{int(stall_s)}"
    tag = f"stall-{stall_s:g}"
    start_worker(redis_url, queue, "--concurrency", "8")
    client = redis.Redis.from_url(redis_url)
    client.set(f"agdist:hold:{tag}", 1)  # none finishes before the stall, however late seen
    leaves = [Parameter(float(i), role=f"x{i}") for i in range(6)]
    outs = [F.Held.apply(p, tag) for p in leaves]
    url = f"redis://127.0.0.1:{proxy.port}/0"
    async with open_redis_executor(url, queue=queue, timeout_s=60) as ex:
        replies = keys.reply_stream(queue, ex.client_id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(outs, executor=ex))
            await wait_until(lambda: client.llen(f"agdist:started:{tag}") == 6)
            proxy.pause()
            stalled_at = time.monotonic()
            client.delete(f"agdist:hold:{tag}")
            # The six finish and answer while the client cannot read.
            await wait_until(lambda: client.xlen(replies) == 6)
            await anyio.sleep(max(0.0, stall_s - (time.monotonic() - stalled_at)))
            assert client.xlen(replies) == 6  # still there, unread (they expired after 2 s)
            proxy.resume()
        # Completed by the replies, nothing sent again: lost replies would have failed the
        # pass at its 60 s timeout (RemoteTimeoutError), or been sent again.
        assert ex.stats.completed == 6 and ex.stats.resent == 0
    assert [p.grad.data for p in leaves] == [1.0] * 6  # type: ignore[union-attr]
    assert runs(redis_url, tag) == 6  # each once
    assert client.xlen(keys.dead_stream(queue)) == 0
    client.close()


@pytest.mark.parametrize("stall_s", [3.0, 6.0])
async def test_tasks_queued_behind_busy_slots_while_the_client_stalls_are_sent_again(
    redis_url: str, proxy: Any, start_worker: StartWorker, stall_s: float
) -> None:
    """A worker of one slot skips this client's queued tasks while its key lapses. The
    heartbeats sent during the stall fail on the client, but their bytes reach Redis when
    the connection moves again and renew the key: the next good beat must still count as
    a lapse and send the skipped tasks again (it found the key, and the client waited its
    whole timeout, in 5 of 8 runs of a reviewer's probe)."""
    queue = f"queued{int(stall_s)}"
    tag = f"queued-{stall_s:g}"
    start_worker(redis_url, queue, "--concurrency", "1")
    client = redis.Redis.from_url(redis_url)
    leaves = [Parameter(float(i), role=f"x{i}") for i in range(4)]
    outs = [F.Sleep.apply(p, 2.5, tag) for p in leaves]
    url = f"redis://127.0.0.1:{proxy.port}/0"
    async with open_redis_executor(url, queue=queue, timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(outs, executor=ex))
            await wait_until(lambda: client.llen(f"agdist:started:{tag}") == 1)
            proxy.pause()
            stalled_at = time.monotonic()
            await wait_until(lambda: time.monotonic() - stalled_at >= stall_s)
            proxy.resume()
        # Completed: the skipped tasks went again and ran (else the pass would have failed
        # at its 120 s timeout with RemoteTimeoutError).
        print(f"stall {stall_s:g} s: completed, resent {ex.stats.resent}")
    assert [p.grad.data for p in leaves] == [1.0] * 4  # type: ignore[union-attr]
    client.close()


async def test_a_replay_of_a_task_whose_reply_its_stalled_client_has_not_read_is_not_run(
    redis_url: str, proxy: Any, start_worker: StartWorker
) -> None:
    """Issue #39: a copy of the task's entry added while its reply waits unread (the client's
    connection stalled past its heartbeat) is dead-lettered ``replayed``, unrun and
    unanswered; the client, moving again, reads the one reply of the first run."""
    queue, tag = "unread", "unread"
    start_worker(redis_url, queue, "--concurrency", "4")
    client = redis.Redis.from_url(redis_url)
    x = Parameter(2.0, role="x")
    url = f"redis://127.0.0.1:{proxy.port}/0"
    client.set(f"agdist:hold:{tag}", 1)  # its entry is still there when the test copies it
    async with open_redis_executor(url, queue=queue, timeout_s=60) as ex:
        replies = keys.reply_stream(queue, ex.client_id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(F.Held.apply(x, tag), executor=ex))
            await wait_until(lambda: client.llen(f"agdist:started:{tag}") == 1)
            ((_, entry),) = client.xrange(keys.task_stream(queue))
            proxy.pause()
            client.delete(f"agdist:hold:{tag}")
            await wait_until(lambda: client.xlen(replies) == 1)  # answered
            await wait_until(lambda: not client.exists(keys.client_key(queue, ex.client_id)))
            # Without the hints that name its client (which looks dead now: its copy would
            # be skipped as client_gone), as a replayer may strip them.
            signed = {k: v for k, v in entry.items() if k in (keys.F_MESSAGE, keys.F_SIGNATURE)}
            client.xadd(keys.task_stream(queue), signed)  # type: ignore[arg-type]
            dead = keys.dead_stream(queue)
            await wait_until(lambda: client.xlen(dead) == 1)
            proxy.resume()
        ((_, letter),) = client.xrange(dead)
        assert letter[keys.F_REASON] == b"replayed"
        assert b"was answered already" in letter[keys.F_ERROR]
        assert ex.stats.completed == 1 and ex.stats.duplicate_replies == 0
        assert ex.stats.resent == 0
    assert x.grad is not None and x.grad.data == 1.0
    assert runs(redis_url, tag) == 1
    client.close()


async def test_a_task_skipped_just_after_its_lapsed_client_looked_is_sent_again(
    redis_url: str, proxy: Any, start_worker: StartWorker, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #39: a worker that found the client gone just before its heartbeat came back may
    skip one of its tasks after the client looked for skipped ones. The client looks again
    at its next beats, and sends it again (here the test deletes the entry itself, as that
    worker's skip would, once the client's first look is over)."""
    queue = "lateskip"
    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream(queue)
    leaves = [Parameter(float(i), role=f"x{i}") for i in range(3)]
    outs = [F.Sleep.apply(p, 0.0, "lateskip") for p in leaves]
    url = f"redis://127.0.0.1:{proxy.port}/0"
    async with open_redis_executor(url, queue=queue, timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(outs, executor=ex))
            await wait_until(lambda: client.xlen(stream) == 3)  # queued: no worker yet
            proxy.pause()
            await wait_until(lambda: not client.exists(keys.client_key(queue, ex.client_id)))
            proxy.resume()
            await wait_until(lambda: "heartbeat lapsed" in caplog.text)  # it looked: all queued
            assert ex.stats.resent == 0
            (first, _), *_ = client.xrange(stream)
            client.xdel(stream, first)
            start_worker(redis_url, queue, wait=False)
        # Completed once a worker started (the 120 s timeout would have raised instead).
        assert ex.stats.resent == 1 and ex.stats.completed == 3
    assert [p.grad.data for p in leaves] == [1.0] * 3  # type: ignore[union-attr]
    assert "skipped after this client's heartbeat came back" in caplog.text
    client.close()
