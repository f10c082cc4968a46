"""A dead client's tasks do not run and its replies expire; dead letters stay small.

Issue #24 point 14 and issue #28 point 3, with a real redis-server, real worker
processes and, for a client's death, a real client process killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import HERE, SECRET, StartWorker, wait_until

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")

# A client of 200 remote nodes sleeping 1 s each, on queue argv[1] at AGDIST_REDIS_URL.
CLIENT = """
import sys, anyio
import agdist_functions as F
from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
import os

async def main():
    leaves = [Parameter(1.0) for _ in range(200)]
    outs = [F.Sleep.apply(p, 1.0, "doomed") for p in leaves]
    async with open_redis_executor(os.environ["AGDIST_REDIS_URL"], queue=sys.argv[1], timeout_s=300) as ex:
        await backward(outs, executor=ex)

anyio.run(main)
"""


def client_keys(client: redis.Redis, queue: str) -> list[bytes]:
    """The reply streams and heartbeat keys of ``queue``'s clients."""
    return [
        *client.scan_iter(match=f"asyncgraph:{{{queue}}}:reply:*"),
        *client.scan_iter(match=f"asyncgraph:{{{queue}}}:client:*"),
    ]


def start_client(url: str, queue: str) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        AGDIST_REDIS_URL=url,
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("ASYNCGRAPH_SECRET", None)
    return subprocess.Popen([sys.executable, "-c", CLIENT, queue], env=env)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour
async def test_a_killed_clients_queued_tasks_do_not_run_and_its_reply_stream_expires(
    redis_url: str, start_worker: StartWorker
) -> None:
    queue = "doomed"
    start_worker(redis_url, queue, *FAST, "--concurrency", "2")
    client = redis.Redis.from_url(redis_url)
    proc = start_client(redis_url, queue)
    try:
        await wait_until(lambda: client.llen("agdist:started:doomed") >= 2)
        assert client.xlen(keys.task_stream(queue)) == 200  # all queued or running
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        # Every task is settled: the two running finish, the rest are skipped.
        await wait_until(lambda: client.xlen(keys.task_stream(queue)) == 0)
        settled_s = time.monotonic() - killed_at
        runs = int(client.llen("agdist:started:doomed"))
        print(f"{runs} of 200 tasks ran after the client's death; all settled in {settled_s:.1f} s")
        # Death is seen within CLIENT_TTL_MS + a recheck (2.25 s): 2 running at the kill,
        # and 2 more per second of 1 s tasks on 2 slots until then (about 8 on an idle
        # machine). Running them all would take 100 s: the bounds are a generous fraction
        # of that, so a loaded machine's lag is not taken for a fault.
        assert runs <= 50, f"{runs} of 200 tasks of a dead client ran"
        assert settled_s < 50, settled_s
        # Its heartbeat key goes on that clock; its reply stream (the replies of the tasks
        # that were running) is kept as long as the client could have waited for them, its
        # timeout (300 s) after the last reply, and no longer (issue #39).
        await wait_until(
            lambda: not list(client.scan_iter(match=f"asyncgraph:{{{queue}}}:client:*"))
        )
        (stream,) = client_keys(client, queue)
        assert 240_000 < int(client.pttl(stream)) <= 301_000  # 60 s of slack for a slow read
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_client_whose_loop_stalls_past_its_heartbeat_sends_its_tasks_again(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Workers take a client whose loop is blocked for 3 s for dead; its tasks still complete."""
    queue = "stalled"
    start_worker(redis_url, queue, *FAST, "--concurrency", "1")
    client = redis.Redis.from_url(redis_url)
    leaves = [Parameter(1.0, role=f"s{i}") for i in range(10)]
    outs = [F.Sleep.apply(p, 0.5, "stalled") for p in leaves]
    async with open_redis_executor(redis_url, queue=queue, timeout_s=60) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(outs, executor=ex))
            await wait_until(lambda: client.llen("agdist:started:stalled") >= 1)
            time.sleep(3.0)  # noqa: ASYNC251 (the point: this loop is blocked, beats stop)
        assert ex.stats.resent >= 1
    assert [p.grad.data for p in leaves] == [1.0] * 10  # type: ignore[union-attr]
    client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour
async def test_ten_thousand_forged_64k_entries_leave_a_few_mb_of_dead_letters(
    redis_url: str, start_worker: StartWorker
) -> None:
    """10,000 x 64 KiB of garbage from a writer without the secret: Redis memory measured."""
    queue = "garbage"
    start_worker(redis_url, queue, *FAST, env={"ASYNCGRAPH_SECRET": SECRET})
    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream(queue)
    garbage = os.urandom(64 * 1024)
    before = int(client.info("memory")["used_memory"])
    for _ in range(20):  # 500 at a time: Redis never holds all 640 MB at once
        pipe = client.pipeline(transaction=False)
        for _ in range(500):
            pipe.xadd(stream, {keys.F_MESSAGE: garbage, keys.F_SIGNATURE: b"00" * 32})
        pipe.execute()
        await wait_until(lambda: client.xlen(stream) == 0)
    after = int(client.info("memory")["used_memory"])
    dead = keys.dead_stream(queue)
    assert client.xlen(dead) == 10_000
    ((_, last),) = client.xrevrange(dead, count=1)
    assert last[keys.F_REASON] == b"forged"
    assert last[keys.F_ORIGINAL] == garbage[:256]  # enough to tell what it was
    grown_mb = (after - before) / 1e6
    print(f"used_memory grew {grown_mb:.1f} MB for 10,000 dead letters of 64 KiB garbage")
    assert grown_mb < 20, grown_mb
    client.close()
