"""Forged, unsigned and malformed messages are dead-lettered while good tasks keep flowing."""

from __future__ import annotations

import os
from typing import Any

import agdist_functions as F
import anyio
import msgpack
import pytest
import redis
from agdist_helpers import SECRET, StartWorker, wait_until

from asyncgraph import Parameter, backward
from asyncgraph.executors import open_redis_executor
from asyncgraph.wire import _keys as keys
from asyncgraph.wire._schema import ReplyMessage, TaskMessage, encode
from asyncgraph.wire._signing import Signer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

QUEUE = "secure"
CLIENT = "0" * 32


def task(signer: Signer, **overrides: Any) -> tuple[bytes, bytes]:
    fields: dict[str, Any] = {
        "queue": QUEUE, "client": CLIENT, "id": "1", "function": "agdist_functions:Noop",
        "fingerprint": "x", "op": "backward", "ttl_ms": 60_000,
        "payload": {"ctx": {"saved": [], "needs": [True], "attrs": {}}, "g": [[1.0, ""]]},
    }
    fields.update(overrides)
    return encode(TaskMessage(**fields), signer)


def bad_entries() -> dict[str, dict[bytes, bytes]]:
    good_packed, good_sig = task(Signer(SECRET))
    forged_packed, forged_sig = task(Signer("another-secret-of-16-bytes"))
    unsigned_packed, _ = task(Signer(None))
    wrong_types = msgpack.packb({"v": 1, "k": "task", "q": QUEUE, "c": CLIENT, "id": 7,
                                 "fn": ["x"], "fp": None, "op": "backward", "ttl": "soon", "p": 3})
    signer = Signer(SECRET)
    noise, huge = os.urandom(200), b"\xc4" + b"x" * 300_000
    # Correctly signed garbage: it passes the signature check and fails decoding.
    return {
        "random bytes": {keys.F_MESSAGE: noise, keys.F_SIGNATURE: signer.sign(noise)},
        "no message field": {b"hello": b"world"},
        "wrong types": {keys.F_MESSAGE: wrong_types, keys.F_SIGNATURE: signer.sign(wrong_types)},
        "huge": {keys.F_MESSAGE: huge, keys.F_SIGNATURE: signer.sign(huge)},
        "unsigned": {keys.F_MESSAGE: unsigned_packed, keys.F_SIGNATURE: b""},
        "forged": {keys.F_MESSAGE: forged_packed, keys.F_SIGNATURE: forged_sig},
        "tampered": {keys.F_MESSAGE: good_packed.replace(b"Noop", b"Boom"),
                     keys.F_SIGNATURE: good_sig},
        "not a map": {keys.F_MESSAGE: msgpack.packb([1, 2, 3]),
                      keys.F_SIGNATURE: signer.sign(msgpack.packb([1, 2, 3]))},
        "old version": {keys.F_MESSAGE: msgpack.packb({"v": 0}),
                        keys.F_SIGNATURE: signer.sign(msgpack.packb({"v": 0}))},
    }


async def test_bad_messages_are_dead_lettered_while_good_tasks_flow(
    redis_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker(redis_url, QUEUE, "--max-message-bytes", "100000",
                          env={"ASYNCGRAPH_SECRET": SECRET})
    client = redis.Redis.from_url(redis_url)
    stream = keys.task_stream(QUEUE)
    entries = bad_entries()
    leaves = [Parameter(float(i)) for i in range(30)]
    outs = [F.Scale.apply(F.Noop.apply(p), 2.0) for p in leaves]
    async with open_redis_executor(redis_url, queue=QUEUE, secret=SECRET, timeout_s=20) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(outs, executor=ex))
            for fields in entries.values():  # interleaved with the good tasks
                client.xadd(stream, fields)
                await anyio.sleep(0.01)
        assert [p.grad.data for p in leaves] == [2.0] * 30  # type: ignore[union-attr]

        # A forged reply to this client is rejected, not joined.
        packed, _ = encode(ReplyMessage(QUEUE, ex.client_id, "1", "mallory", [[9.0, ""]]),
                           Signer("mallory-secret-16bytes"))
        client.xadd(keys.reply_stream(QUEUE, ex.client_id),
                    {keys.F_MESSAGE: packed, keys.F_SIGNATURE: b"ff"})
        await wait_until(lambda: ex.stats.rejected_replies >= 1)

    await wait_until(lambda: client.xlen(keys.dead_stream(QUEUE)) >= len(entries))
    dead = client.xrange(keys.dead_stream(QUEUE))
    reasons = [fields[keys.F_REASON].decode() for _, fields in dead]
    errors = [fields[keys.F_ERROR].decode() for _, fields in dead]
    assert reasons.count("forged") == 3  # unsigned, other secret, tampered
    assert reasons.count("malformed") == len(entries) - 3
    assert any("above the limit" in e for e in errors)
    assert any("field 'ttl' must be an int" in e for e in errors)
    assert any("no message field" in e for e in errors)
    assert any("protocol version" in e for e in errors)
    assert client.xlen(stream) == 0  # everything was acknowledged and deleted
    assert worker.proc.poll() is None  # and the worker is still serving
    client.close()


async def test_task_past_its_deadline_is_skipped(redis_url: str, start_worker: StartWorker) -> None:
    import urllib.request

    from asyncgraph._redis_server import free_port

    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(keys.task_stream("late"), keys.GROUP, id="0", mkstream=True)
    packed, sig = task(Signer(None), queue="late", ttl_ms=1)
    client.xadd(keys.task_stream("late"), {keys.F_MESSAGE: packed, keys.F_SIGNATURE: sig})
    port = free_port()
    start_worker(redis_url, "late", "--health-port", str(port), "--health-host", "127.0.0.1")

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    await wait_until(lambda: 'asyncgraph_worker_tasks_total{outcome="expired"} 1' in metrics())
    assert client.xlen(keys.reply_stream("late", CLIENT)) == 0  # no reply: the client gave up
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:  # noqa: ASYNC210
        assert response.status == 200
    client.close()
