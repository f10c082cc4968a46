"""The holes fault injection found (issue #11), each with real Redis and real workers."""

from __future__ import annotations

import functools
import json
import signal

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, http_get, wait_until

from asyncgraph import Parameter, RemoteError, RemoteTimeoutError, backward
from asyncgraph.distributed import RedisServer, open_redis_executor
from asyncgraph.distributed._redis_server import free_port
from asyncgraph.distributed.wire import _keys as keys

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")


def pending(client: redis.Redis, queue: str) -> int:
    return int(client.xpending(keys.task_stream(queue), keys.GROUP)["pending"])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour
async def test_an_entry_of_400k_fields_is_dead_lettered_and_holds_no_task_of_a_dead_worker(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Point 1: a dead worker's tasks, reclaimable at the moment a poison entry arrives."""
    queue = "wide"
    client = redis.Redis.from_url(redis_url)
    first = start_worker(redis_url, queue, *FAST)
    leaves = [Parameter(float(i + 1), role=f"p{i}") for i in range(3)]
    outs = [F.Sleep.apply(p, 1.0, f"wide{i}") for i, p in enumerate(leaves)]
    async with open_redis_executor(redis_url, queue=queue, timeout_s=240) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(backward, outs, executor=ex))
            await wait_until(lambda: all(client.llen(f"agdist:started:wide{i}") for i in range(3)))
            start_worker(redis_url, queue, *FAST)
            first.kill()  # its 3 tasks become reclaimable while the poison entry is read
            pairs: list[str] = []
            for i in range(400_000):
                pairs += [f"a{i}", "b"]
            client.execute_command("XADD", keys.task_stream(queue), "*", *pairs)
    assert [p.grad.data for p in leaves] == [1.0, 1.0, 1.0]  # type: ignore[union-attr]
    await wait_until(lambda: client.xlen(keys.task_stream(queue)) == 0, timeout_s=120)
    assert pending(client, queue) == 0
    (dead,) = [f for _, f in client.xrange(keys.dead_stream(queue)) if b"fields" in f[b"error"]]
    assert dead[b"reason"] == b"malformed"
    assert b"entry has 400000 fields" in dead[b"error"]
    client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_reply_redis_refuses_is_retried_then_reported_in_redis_words(
    start_worker: StartWorker,
) -> None:
    """Point 2: at maxmemory (noeviction) the reply MULTI is aborted; nothing is re-run."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        start_worker(server.url, "oom", *FAST)
        x = Parameter(1.0, role="x")
        failures: list[BaseException] = []

        async def run(ex: object) -> None:
            try:
                await backward(F.Nap.apply(x, 1.0), executor=ex)  # type: ignore[arg-type]
            except RemoteError as exc:
                failures.append(exc)

        async with open_redis_executor(server.url, queue="oom", timeout_s=60) as ex:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, ex)
                await wait_until(lambda: pending(client, "oom") == 1)
                client.config_set("maxmemory-policy", "noeviction")
                client.config_set("maxmemory", 1)  # over the limit: every write is refused
                # The worker retries, then acknowledges the task (allowed at maxmemory)
                # and keeps trying to send its client a short error reply.
                await wait_until(lambda: pending(client, "oom") == 0)
                client.config_set("maxmemory", 0)  # memory is back: the short reply gets through
        (failure,) = failures
        assert "Redis refused to store the reply" in str(failure)
        assert "OOM" in str(failure) and "maxmemory" in str(failure)
        assert x.grad is None  # nothing committed
        client.close()


async def test_abandoned_synchronous_calls_hold_their_slots_and_drain_still_exits(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Point 5: a hung synchronous backward is abandoned, counted, and does not block exit."""
    port = free_port()
    worker = start_worker(
        redis_url,
        "hung",
        "--concurrency",
        "2",
        "--drain-timeout-s",
        "1",
        "--health-port",
        str(port),
        "--health-host",
        "127.0.0.1",
    )
    leaves = [Parameter(1.0, role=f"h{i}") for i in range(2)]
    # Both tasks are picked up well within the timeout, even on a loaded machine, and
    # still hang when it strikes.
    outs = [F.SyncSleep.apply(p, 300.0, f"hung{i}") for i, p in enumerate(leaves)]
    async with open_redis_executor(redis_url, queue="hung", timeout_s=30) as ex:
        with pytest.raises(RemoteTimeoutError):
            await backward(outs, executor=ex)  # times out and cancels its tasks

    def readiness() -> dict[str, object]:
        return dict(json.loads(http_get(port, "/readyz")[1]))

    await wait_until(lambda: readiness().get("abandoned") == 2)
    assert readiness()["in_flight"] == 0  # the tasks ended; their threads did not
    client = redis.Redis.from_url(redis_url)
    await wait_until(
        lambda: any(
            json.loads(v).get("abandoned") == 2
            for v in client.hvals(keys.workers_info_hash("hung"))
        )
    )
    client.close()
    from asyncgraph.distributed._status import fleet_status, format_status

    shown = format_status(await fleet_status(redis_url, "hung"))
    assert "2 abandoned synchronous call(s) holding slots" in shown, shown
    worker.signal(signal.SIGTERM)
    # The drain deadline (1 s) is honoured: the exit does not wait for the hung threads
    # (300 s, past this wait's deadline).
    assert await anyio.to_thread.run_sync(worker.proc.wait, 120) == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_message_that_would_decode_into_gigabytes_is_refused_early(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Point 4: decoded size is bounded while decoding; the worker goes on serving."""
    queue = "flood"
    client = redis.Redis.from_url(redis_url)
    start_worker(redis_url, queue, *FAST)
    # 7 arrays of 1,000,000 empty arrays each (every array within max_container_len).
    inner = b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000
    flood = b"\x97" + inner * 7
    for _ in range(3):
        client.xadd(keys.task_stream(queue), {"m": flood, "s": b""})
    x = Parameter(2.0)
    async with open_redis_executor(redis_url, queue=queue, timeout_s=20) as ex:
        await backward(F.Scale.apply(x, 3.0), executor=ex)
    assert x.grad is not None and x.grad.data == 3.0
    await wait_until(lambda: client.xlen(keys.dead_stream(queue)) >= 3)
    reasons = [f[b"error"] for _, f in client.xrange(keys.dead_stream(queue))]
    assert all(b"more than 100000 arrays and maps" in r for r in reasons), reasons
    assert pending(client, queue) == 0
    client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_timeout_diagnosis_names_tasks_held_by_a_stopped_worker(
    redis_url: str, start_worker: StartWorker
) -> None:
    """Point 6c: after a SIGSTOP, held tasks are not counted as waiting."""
    stopped = start_worker(redis_url, "silent", *FAST)
    x = Parameter(1.0)
    client = redis.Redis.from_url(redis_url)
    # A timeout long enough that the stopped worker's heartbeat has lapsed when it strikes,
    # however late polling sees the task start.
    async with open_redis_executor(redis_url, queue="silent", timeout_s=20) as ex:
        async with anyio.create_task_group() as tg:
            failures: list[RemoteTimeoutError] = []

            async def run() -> None:
                try:
                    await backward(F.Sleep.apply(x, 120.0, "silent"), executor=ex)
                except RemoteTimeoutError as exc:
                    failures.append(exc)

            tg.start_soon(run)
            await wait_until(lambda: client.llen("agdist:started:silent"))
            stopped.signal(signal.SIGSTOP)
    stopped.signal(signal.SIGCONT)
    client.close()
    (failure,) = failures
    assert "no worker of queue 'silent' is alive" in str(failure)
    assert "0 task(s) waiting, 1 held by silent worker(s)" in str(failure)


def test_an_entry_settled_a_moment_ago_is_not_run_again_when_a_late_claim_returns_it() -> None:
    """Point 6a: the reclaimer's XAUTOCLAIM ran just before this worker's reply write."""
    from asyncgraph.distributed import Worker, WorkerConfig

    worker = Worker(WorkerConfig("redis://127.0.0.1:1/0"), {})
    worker._ctx.slots.release([b"5-0"])  # settled and acknowledged by this worker
    worker._tasks.admit(b"5-0", [b"m", b"whatever", b"s", b""], 2)  # then a late claim returns it
    assert b"5-0" not in worker._ctx.slots.held  # not taken, not run, not answered twice


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_abandoned_calls_are_counted_until_they_return_and_never_before_they_start() -> None:
    """Point 5, the bookkeeping: a call cancelled while it waits for a thread never runs."""
    import threading

    from asyncgraph.distributed.worker._execute import Threads

    ended = anyio.Event()
    threads = Threads(1, on_ended=ended.set)
    release = threading.Event()
    ran: list[str] = []

    def blocking(name: str) -> str:
        ran.append(name)
        release.wait(10)
        return name

    async with anyio.create_task_group() as tg:
        tg.start_soon(threads.run, blocking, "first")  # holds the only thread
        await wait_until(lambda: ran == ["first"])
        with anyio.move_on_after(0.2):
            await threads.run(blocking, "second")  # waits for the thread, then is cancelled
        assert threads.abandoned == 0
        tg.cancel_scope.cancel()  # the first is cancelled while it runs: abandoned
    assert threads.abandoned == 1
    release.set()
    with anyio.fail_after(60):
        await ended.wait()
    assert threads.abandoned == 0
    assert ran == ["first"]  # the second never ran


def test_a_task_hook_that_fails_on_the_worker_is_logged_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a client sends as task metadata must never crash a worker, nor a hook lose a reply."""
    from collections.abc import Callable, Iterator
    from contextlib import contextmanager

    from asyncgraph.distributed.worker._around import AroundTask
    from asyncgraph.taskhooks import TaskInfo

    events: list[str] = []

    class Hook:
        def __init__(self, name: str, fail: str = "") -> None:
            self.name, self.fail = name, fail

        def serving(self, settings: object) -> object:
            return lambda: None

        def task_metadata(self) -> None:
            return None

        @contextmanager
        def around_task(self, metadata: object, info: object) -> Iterator[Callable[[], object]]:
            if self.fail == "enter":
                raise ValueError(f"cannot read {metadata!r}")
            events.append(f"enter {self.name}")
            try:
                yield (lambda: 1 / 0) if self.fail == "metadata" else (lambda: {"got": metadata})
            except BaseException as exc:
                events.append(f"{self.name} saw {type(exc).__name__}")
                raise
            finally:
                events.append(f"exit {self.name}")
                if self.fail == "exit":
                    raise RuntimeError("exit failed")

        def on_reply(self, metadata: object) -> None:
            return None

    hooks = {
        h.name: h
        for h in (
            Hook("ok"),
            Hook("fragile", "enter"),
            Hook("late", "exit"),
            Hook("mute", "metadata"),
        )
    }
    info = TaskInfo("f", "backward", "q", "w", "1", 0.0, 1)
    with AroundTask(hooks, {"ok": "sent", "fragile": "junk"}, info, "w") as around:
        events.append("task")
    assert events == [
        "enter ok",
        "enter late",
        "enter mute",
        "task",
        "exit mute",
        "exit late",
        "exit ok",
    ]
    assert around.metadata() == {"ok": {"got": "sent"}, "late": {"got": None}}
    assert "task hook 'fragile' failed before a task" in caplog.text
    assert "task hook 'late' failed after a task" in caplog.text
    assert "task hook 'mute' failed after a task" in caplog.text

    # The exception that ends the block reaches every hook, and none can swallow it.
    events.clear()
    with pytest.raises(KeyError):
        with AroundTask({"ok": hooks["ok"]}, {}, info, "w"):
            raise KeyError("stopping")
    assert events == ["enter ok", "ok saw KeyError", "exit ok"]
