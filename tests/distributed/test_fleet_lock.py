"""``local_fleet``'s lock: its embedded Redis wants a password, its workers a secret, and the
user's ``ASYNCGRAPH_SECRET`` / ``ASYNCGRAPH_ALLOWED_BASE_URLS`` reach the workers.

Real processes: a redis-server (valkey-server) and ``asyncgraph worker`` children.
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import redis
from agdist_helpers import SECRET, wait_until

from asyncgraph import Parameter, RemoteTimeoutError, Variable
from asyncgraph.distributed import (
    ConfigError,
    RedisServer,
    local_fleet,
    open_redis_executor,
)
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._schema import TaskMessage, encode
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.models._testing import OpenAITestServer
from asyncgraph.resp import parse_redis_url

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

WORKER_KEY = "sk-fleet-worker-key"


def _queue() -> str:
    return f"fleet-lock-{uuid.uuid4().hex[:8]}"


def _reply_without_auth(port: int) -> bytes:
    """What the server answers a PING from a client that gave no password."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(200)


def test_a_redis_server_password_must_need_no_escaping() -> None:
    for bad in ("", "with space", "a@b", "x:y", "p/q"):
        with pytest.raises(ValueError, match="letters, digits"):
            RedisServer(password=bad)


def test_a_bad_secret_in_the_environment_is_named_before_the_fleet_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCGRAPH_SECRET", "too-short")
    with pytest.raises(ConfigError, match=r"^ASYNCGRAPH_SECRET must be at least 16 bytes"):
        with local_fleet(1, ["asyncgraph.text"], queue=_queue()):
            pass
    with pytest.raises(ConfigError, match=r"^secret must be at least 16 bytes"):
        with local_fleet(1, ["asyncgraph.text"], queue=_queue(), secret="short"):
            pass


def test_a_redis_server_with_a_password_refuses_clients_without_it(
    redis_server_binary: None,
) -> None:
    with RedisServer(password="s3cret-pass.word~") as server:
        assert server.url == f"redis://:s3cret-pass.word~@127.0.0.1:{server.port}/0"
        assert _reply_without_auth(server.port).startswith(b"-NOAUTH")
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        # The password is in a file of the server's private directory, not in its argv.
        assert server._proc is not None
        assert "s3cret" not in " ".join(map(str, server._proc.args))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the worker side is under test
async def test_the_fleet_redis_wants_a_password_and_the_workers_a_signature(
    redis_server_binary: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCGRAPH_SECRET", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", WORKER_KEY)
    queue = _queue()
    with OpenAITestServer() as model_server:
        with local_fleet(1, ["asyncgraph.text"], queue=queue, secret=SECRET) as url:
            address = parse_redis_url(url)
            password = address.password
            assert password and len(password) >= 32  # random: 128 bits
            # No password: nothing but NOAUTH, not even a PING.
            assert _reply_without_auth(address.port).startswith(b"-NOAUTH")
            # With the password but not the secret: an unsigned LLMCall task aimed at the
            # test server is dead-lettered as forged, and the worker never calls the model.
            packed, signature = encode(
                TaskMessage(
                    queue=queue,
                    client="0" * 32,
                    id="1",
                    function="asyncgraph.text._functions:LLMCall",
                    fingerprint="x",
                    op="backward",
                    ttl_ms=60_000,
                    payload={"ctx": {"saved": [], "needs": [True], "attrs": {}}, "g": []},
                    expiry_ms=int(time.time() * 1000) + 60_000,
                ),
                Signer(None),
            )
            assert signature == b""
            client = redis.Redis.from_url(url)
            client.xadd(keys.task_stream(queue), {keys.F_MESSAGE: packed})
            await wait_until(lambda: client.xlen(keys.dead_stream(queue)) >= 1)
            ((_, dead),) = client.xrange(keys.dead_stream(queue))
            client.close()
            assert dead[keys.F_REASON] == b"forged"
            assert b"unsigned message" in dead[keys.F_ERROR]
        assert model_server.requests == []
    with local_fleet(1, ["asyncgraph.text"], queue=queue, secret=SECRET) as again:
        assert parse_redis_url(again).password != password  # a new one every time


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_environment_s_secret_and_base_urls_reach_the_fleet_s_workers(
    redis_server_binary: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgraph.text import llm_call

    queue = _queue()
    with OpenAITestServer() as server:
        monkeypatch.setenv("ASYNCGRAPH_SECRET", SECRET)
        monkeypatch.setenv("ASYNCGRAPH_ALLOWED_BASE_URLS", f"https://x.invalid/v1,{server.url}")
        monkeypatch.setenv("OPENAI_API_KEY", WORKER_KEY)
        prompt = Parameter("Answer.", role="system prompt")
        answer = await llm_call(prompt, "1 + 1?", model="openai:gpt-test", base_url=server.url)
        with local_fleet(1, ["asyncgraph.text"], queue=queue) as url:
            # Signed with the environment's secret (the client's default), and the worker
            # checks it: signed with another, the backward is refused.
            async with open_redis_executor(url, queue=queue, timeout_s=30) as ex:
                await answer.backward(Variable("too long"), executor=ex, retain_graph=True)
            async with open_redis_executor(
                url, queue=queue, timeout_s=5, secret="another-secret-of-16-bytes"
            ) as ex:
                with pytest.raises(RemoteTimeoutError, match="signs with another secret"):
                    await answer.backward(Variable("too long"), executor=ex)
        # The forward (this process) and the worker's backward, with the worker's key.
        auths = [r.headers.get("authorization") for r in server.requests]
        assert len(auths) >= 2 and set(auths) == {f"Bearer {WORKER_KEY}"}
    assert prompt.grad is not None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_base_url_given_to_the_fleet_is_allowed_on_its_workers(
    redis_server_binary: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgraph.text import llm_call

    monkeypatch.delenv("ASYNCGRAPH_ALLOWED_BASE_URLS", raising=False)
    monkeypatch.delenv("ASYNCGRAPH_SECRET", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", WORKER_KEY)
    queue = _queue()
    with OpenAITestServer() as server:
        prompt = Parameter("Answer.", role="system prompt")
        answer = await llm_call(prompt, "1 + 1?", model="openai:gpt-test", base_url=server.url)
        forward = len(server.requests)
        with local_fleet(
            1, ["asyncgraph.text"], queue=queue, secret=SECRET, allowed_base_urls=[server.url]
        ) as url:
            async with open_redis_executor(url, queue=queue, timeout_s=30, secret=SECRET) as ex:
                await answer.backward(Variable("too long"), executor=ex)
        assert len(server.requests) > forward  # the worker called the model
    assert prompt.grad is not None
