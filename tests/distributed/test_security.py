"""Forged, unsigned and malformed messages are dead-lettered while good tasks keep flowing."""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

import agdist_functions as F
import anyio
import msgpack
import pytest
import redis
from agdist_helpers import SECRET, CaptureServer, StartWorker, wait_until

from asyncgraph import Parameter, RemoteError, RemoteTimeoutError, Variable, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import ReplyMessage, TaskMessage, encode
from asyncgraph.distributed.wire._signing import Signer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

QUEUE = "secure"
CLIENT = "0" * 32


def task(signer: Signer, **overrides: Any) -> tuple[bytes, bytes]:
    fields: dict[str, Any] = {
        "queue": QUEUE,
        "client": CLIENT,
        "id": "1",
        "function": "agdist_functions:Noop",
        "fingerprint": "x",
        "op": "backward",
        "ttl_ms": 60_000,
        "expiry_ms": int(time.time() * 1000) + 60_000,  # this host's clock is Redis's
        "payload": {"ctx": {"saved": [], "needs": [True], "attrs": {}}, "g": [[1.0, ""]]},
    }
    fields.update(overrides)
    return encode(TaskMessage(**fields), signer)


def bad_entries() -> dict[str, dict[bytes, bytes]]:
    good_packed, good_sig = task(Signer(SECRET))
    forged_packed, forged_sig = task(Signer("another-secret-of-16-bytes"))
    unsigned_packed, _ = task(Signer(None))
    wrong_types = msgpack.packb(
        {
            "v": keys.PROTOCOL_VERSION,
            "k": "task",
            "q": QUEUE,
            "c": CLIENT,
            "id": 7,
            "fn": ["x"],
            "fp": None,
            "op": "backward",
            "ttl": "soon",
            "p": 3,
        }
    )
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
        "tampered": {
            keys.F_MESSAGE: good_packed.replace(b"Noop", b"Boom"),
            keys.F_SIGNATURE: good_sig,
        },
        "not a map": {
            keys.F_MESSAGE: msgpack.packb([1, 2, 3]),
            keys.F_SIGNATURE: signer.sign(msgpack.packb([1, 2, 3])),
        },
        "old version": {
            keys.F_MESSAGE: msgpack.packb({"v": 0}),
            keys.F_SIGNATURE: signer.sign(msgpack.packb({"v": 0})),
        },
    }


async def test_bad_messages_are_dead_lettered_while_good_tasks_flow(
    redis_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker(
        redis_url, QUEUE, "--max-message-bytes", "100000", env={"ASYNCGRAPH_SECRET": SECRET}
    )
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
        packed, _ = encode(
            ReplyMessage(QUEUE, ex.client_id, "1", "mallory", [[9.0, ""]]),
            Signer("mallory-secret-16bytes"),
        )
        client.xadd(
            keys.reply_stream(QUEUE, ex.client_id),
            {keys.F_MESSAGE: packed, keys.F_SIGNATURE: b"ff"},
        )
        await wait_until(lambda: ex.stats.rejected_replies >= 1)

    await wait_until(lambda: client.xlen(keys.dead_stream(QUEUE)) >= len(entries))
    dead = client.xrange(keys.dead_stream(QUEUE))
    reasons = [fields[keys.F_REASON].decode() for _, fields in dead]
    errors = [fields[keys.F_ERROR].decode() for _, fields in dead]
    assert reasons.count("forged") == 3  # unsigned, other secret, tampered
    assert reasons.count("oversize") == 1  # skipped unread
    assert reasons.count("malformed") == len(entries) - 4
    assert any("above this worker's limit of 100000" in e for e in errors)
    assert any("field 'id' must be a str, got int" in e for e in errors)  # the first field
    assert any("no message field" in e for e in errors)
    assert any("protocol version" in e for e in errors)
    assert client.xlen(stream) == 0  # everything was acknowledged and deleted
    assert worker.proc.poll() is None  # and the worker is still serving
    client.close()


async def test_a_task_past_its_signed_expiry_is_dead_lettered_unrun(
    redis_url: str, start_worker: StartWorker
) -> None:
    import urllib.request

    from asyncgraph.distributed._redis_server import free_port

    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(keys.task_stream("late"), keys.GROUP, id="0", mkstream=True)
    # Expired long ago (its signed expiry, whatever the entry's id says): past its grace too.
    # Its client's wait of 60 s keeps the reply 61 s, however slowly a loaded machine reads.
    packed, sig = task(Signer(None), queue="late", ttl_ms=60_000, expiry_ms=1)
    client.xadd(keys.task_stream("late"), {keys.F_MESSAGE: packed, keys.F_SIGNATURE: sig})
    port = free_port()
    start_worker(redis_url, "late", "--health-port", str(port), "--health-host", "127.0.0.1")

    def metrics() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    await wait_until(lambda: 'asyncgraph_worker_tasks_total{outcome="expired"} 1' in metrics())
    # Counted when settled, written a moment later (the dead letter with the reply).
    await wait_until(lambda: client.xlen(keys.reply_stream("late", CLIENT)))
    ((_, dead),) = client.xrange(keys.dead_stream("late"))
    assert dead[keys.F_REASON] == b"expired"
    # Its client is not known to be gone (the entry says nothing of a heartbeat): a short
    # reply tells it, in case it still waits.
    ((_, reply),) = client.xrange(keys.reply_stream("late", CLIENT))
    assert b"signed expiry" in reply[keys.F_MESSAGE]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:  # noqa: ASYNC210
        assert response.status == 200
    client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_a_worker_sends_its_api_key_only_to_base_urls_it_allows(
    redis_url: str, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgraph.text import llm_call

    key = "sk-worker-key-that-must-not-leak"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # the app side has no key here
    with CaptureServer() as server:
        prompt = Parameter("Answer.", role="system prompt")
        answer = await llm_call(prompt, "1 + 1?", model="openai:gpt-test", base_url=server.base_url)
        assert len(server.requests) == 1  # the forward, from this process, without a key
        assert server.requests[0][1] == ""

        start_worker(redis_url, "keys", "--import", "asyncgraph.text", env={"OPENAI_API_KEY": key})
        async with open_redis_executor(redis_url, queue="keys", timeout_s=20) as ex:
            with pytest.raises(RemoteError) as info:
                await answer.backward(Variable("too long"), executor=ex)
        message = str(info.value)
        assert f"base_url {server.base_url!r} is not allowed" in message
        assert f"--allow-base-url {server.base_url}" in message
        assert "ASYNCGRAPH_ALLOWED_BASE_URLS" in message
        assert len(server.requests) == 1  # the worker never called it

        # Allowed (through the environment; scheme case and a trailing / do not matter):
        # now the key goes there.
        allowed = server.base_url.replace("http://", "HTTP://") + "/"
        start_worker(
            redis_url,
            "keys-allowed",
            "--import",
            "asyncgraph.text",
            env={
                "OPENAI_API_KEY": key,
                "ASYNCGRAPH_ALLOWED_BASE_URLS": f"https://x.invalid/v1, {allowed}",
            },
        )
        async with open_redis_executor(redis_url, queue="keys-allowed", timeout_s=20) as ex:
            await answer.backward(Variable("too long"), executor=ex)
        assert [auth for _, auth in server.requests[1:]] == [f"Bearer {key}"]
    assert prompt.grad is not None


@pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None, reason="the litellm extra is not installed"
)
@pytest.mark.timeout(240)  # each worker imports LiteLLM (seconds) for its first task
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_a_worker_sends_its_key_only_where_its_operator_allows_for_a_litellm_call_param(
    redis_url: str, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue #33: a client with no key gave a litellm: model params={"api_base": URL} (or
    # base_url), and the worker passed them to litellm.completion(), which sent
    # "Authorization: Bearer <the worker's OPENAI_API_KEY>" to URL.
    from asyncgraph.models._testing import OpenAITestServer
    from asyncgraph.text import llm_call

    key = "sk-worker-key-that-must-not-leak"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # the client has no key
    worker_env = {"OPENAI_API_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with OpenAITestServer() as server:
        prompt = Parameter("Answer.", role="system prompt")
        answers = [
            await llm_call(
                prompt,
                "1 + 1?",
                model="simulated",  # the forward runs here; the backward on a worker
                feedback_model="litellm:openai/gpt-test",
                feedback_params={param: server.url},
            )
            for param in ("api_base", "base_url")
        ]

        start_worker(redis_url, "litellm-keys", "--import", "asyncgraph.text", env=worker_env)
        async with open_redis_executor(redis_url, queue="litellm-keys", timeout_s=120) as ex:
            for answer, param in zip(answers, ("api_base", "base_url"), strict=True):
                with pytest.raises(RemoteError) as info:
                    await answer.backward(Variable("too long"), executor=ex)
                message = str(info.value)
                assert f"param {param}={server.url!r} is not allowed in this process" in message
                assert f"--allow-base-url {server.url}" in message
        assert server.requests == []  # the worker never called it

        start_worker(
            redis_url,
            "litellm-keys-allowed",
            "--import",
            "asyncgraph.text",
            "--allow-base-url",
            server.url,
            env=worker_env,
        )
        async with open_redis_executor(
            redis_url, queue="litellm-keys-allowed", timeout_s=120
        ) as ex:
            for answer in answers:
                await answer.backward(Variable("too long"), executor=ex)
        # Allowed by its operator: now the worker's key goes there, and only there.
        assert [r.headers["authorization"] for r in server.requests] == [f"Bearer {key}"] * 2
    assert prompt.grad is not None


def test_base_url_allowlist_is_set_by_workers_only() -> None:
    from asyncgraph.models import ModelConfigError, parse_model_spec
    from asyncgraph.models._spec import restrict_base_urls
    from asyncgraph.text import resolve_model, unregister_model

    url = "http://127.0.0.1:9/v1"
    model = resolve_model("openai:m", url)  # not restricted: an application
    restriction = restrict_base_urls(["http://allowed.example/v1"])
    try:
        with pytest.raises(ModelConfigError, match="is not allowed in this process"):
            resolve_model("openai:m", url)  # also when built before the restriction
        with pytest.raises(ModelConfigError, match="--allow-base-url"):
            parse_model_spec("openai:m", base_url="http://api.openai.com.evil.example/v1")
        assert resolve_model("openai:m", "HTTP://Allowed.example/v1/") is not None
        assert parse_model_spec("openai:m", base_url="https://api.openai.com/v1", api_key="k")
        with pytest.raises(ValueError, match="not an http"):
            restrict_base_urls(["ftp://nope"])
    finally:
        restriction.remove()
    assert resolve_model("openai:m", url) is model
    unregister_model("openai:m", url)
    unregister_model("openai:m", "HTTP://Allowed.example/v1/")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the client's settings, not its loop
async def test_the_client_takes_the_secret_from_the_environment_and_diagnoses_a_missing_one(
    redis_url: str, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_worker(redis_url, QUEUE, env={"ASYNCGRAPH_SECRET": SECRET})
    x = Parameter(2.0)
    monkeypatch.setenv("ASYNCGRAPH_SECRET", SECRET)
    async with open_redis_executor(redis_url, queue=QUEUE, timeout_s=20) as ex:
        await backward(F.Scale.apply(x, 3.0), executor=ex)
    assert x.grad is not None and x.grad.data == 3.0

    # secret="" opts out of the environment's secret: the workers refuse the tasks, and the
    # timeout says why.
    async with open_redis_executor(redis_url, queue=QUEUE, timeout_s=1.5, secret="") as ex:
        with pytest.raises(RemoteTimeoutError) as info:
            await backward(F.Scale.apply(x, 3.0), executor=ex)
    message = str(info.value)
    assert "dead-lettered as unsigned or forged" in message
    assert "this client has no secret" in message and "ASYNCGRAPH_SECRET" in message


def test_a_worker_reads_fewer_entries_after_big_ones() -> None:
    from asyncgraph.distributed.wire._keys import BULK_MARGIN
    from asyncgraph.distributed.worker._intake import ReadSizer
    from asyncgraph.resp import Oversize

    sizer = ReadSizer(batch_size=256, max_bulk=8 * 1024 * 1024 + BULK_MARGIN)
    assert sizer.count(64) == 64
    sizer.note([(b"1-0", [b"m", b"x" * 4 * 1024 * 1024, b"s", b""])])
    assert sizer.count(64) == 16  # 64 MiB budget / 4 MiB entries
    sizer.note([(b"2-0", [b"m", Oversize(10**9), b"s", b""]), None])
    assert sizer.count(64) == 7  # an unread entry counts as the largest readable one
    sizer.note([(b"3-0", [b"m", b"small", b"s", b""])])
    assert sizer.count(300) == 256
    assert sizer.max_items(4) == 32  # an entry of more fields than a task has is not read


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # worker-side behaviour only
async def test_a_task_too_big_for_an_unsigned_worker_fails_at_once(
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, "small", "--max-message-bytes", "20000")
    x = Parameter("draft", role="x")
    async with open_redis_executor(redis_url, queue="small", timeout_s=30) as ex:
        with anyio.fail_after(10):
            with pytest.raises(
                RemoteError,
                match=r"above this worker's limit of 20000.*"
                r"--max-message-bytes",
            ):
                await backward(F.Noop.apply(x), "x" * 50_000, executor=ex)
    client = redis.Redis.from_url(redis_url)
    ((_, dead),) = client.xrange(keys.dead_stream("small"))
    assert dead[keys.F_REASON] == b"oversize" and dead[keys.F_CLIENT] == ex.client_id.encode()
    client.close()
