"""The claim script that rides with a worker's read (NOTE [Replays] in ``worker._admission``).

Real redis-server: the script is run as the reader runs it, right after an XREADGROUP,
and real workers show that a task still runs once, and a copy is still refused, when
the entry's hints lie or Redis has forgotten the script.
"""

from __future__ import annotations

import agdist_functions as F
import pytest
import redis
from agdist_helpers import SECRET, StartWorker

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.worker._admission import (
    CLAIM_SCRIPT,
    EXPIRY_GRACE_MS,
    Claim,
    claim_script_args,
    read_claims,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

QUEUE = "claims"
CLIENT = "ab" * 16
SIGNED = {"ASYNCGRAPH_SECRET": SECRET}


def add(
    client: redis.Redis, task_id: bytes, expiry: bytes = b"1900000000000", **more: bytes
) -> bytes:
    fields = {
        keys.F_MESSAGE: b"m",
        keys.F_CLIENT_HINT: CLIENT.encode(),
        keys.F_TASK_HINT: task_id,
        keys.F_EXPIRY_HINT: expiry,
        **{k.encode(): v for k, v in more.items()},
    }
    return client.xadd(keys.task_stream(QUEUE), fields)  # type: ignore[arg-type,return-value]


def read_and_claim(client: redis.Redis, consumer: str, after: bytes = b"0-0") -> dict[bytes, Claim]:
    """An XREADGROUP and the claim script, in one pipeline, as the worker's reader sends them."""
    pipe = client.pipeline(transaction=False)
    pipe.execute_command(
        "XREADGROUP", "GROUP", keys.GROUP, consumer, "COUNT", 10, "STREAMS",
        keys.task_stream(QUEUE), ">",
    )  # fmt: skip
    pipe.execute_command("EVAL", CLAIM_SCRIPT, *claim_script_args(QUEUE, consumer, after, 10))
    _, claimed = pipe.execute()
    return read_claims(claimed)


def test_the_script_claims_each_entry_just_read_by_its_hints(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xgroup_create(keys.task_stream(QUEUE), keys.GROUP, id="0", mkstream=True)
    first = add(client, b"t1")
    copy = add(client, b"t1")  # the same task again: a replay
    bad = [
        add(client, b"t2", expiry=b"soon"),
        add(client, b"t3", expiry=b"9" * 16),  # more digits than any expiry
        add(client, b"x" * 65),
    ]
    claims = read_and_claim(client, "w1")
    key = keys.ran_key(QUEUE, CLIENT, "t1")
    at = 1_900_000_000_000 + EXPIRY_GRACE_MS
    assert claims == {
        first: Claim(key, at, True, first),
        copy: Claim(key, at, False, first),
    }  # the entries with hints not well formed are left to the round-trip claim
    assert not set(bad) & set(claims)
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    assert client.get(key) == first and abs(now_ms + int(client.pttl(key)) - at) < 5000
    # Only what this consumer just read: another consumer's read claims its own entry,
    # and a read that delivers nothing new claims nothing.
    later = add(client, b"t4")
    assert read_and_claim(client, "w2") == {
        later: Claim(keys.ran_key(QUEUE, CLIENT, "t4"), at, True, later)
    }
    client.delete(keys.ran_key(QUEUE, CLIENT, "t4"))
    assert read_and_claim(client, "w1", after=bad[-1]) == {}
    # A redelivery (delivery count 2: reclaimed) is left to the round-trip claim.
    client.xclaim(keys.task_stream(QUEUE), keys.GROUP, "w1", 0, [later])
    assert read_and_claim(client, "w1", after=bad[-1]) == {}
    assert client.get(keys.ran_key(QUEUE, CLIENT, "t4")) is None
    client.close()


async def test_a_task_runs_once_when_redis_forgot_the_script(
    redis_url: str, start_worker: StartWorker
) -> None:
    """``SCRIPT FLUSH`` (or a restarted Redis): the worker's reader is told NOSCRIPT,
    claims that batch in a round trip of its own, and sends the script again."""
    start_worker(redis_url, QUEUE, env=SIGNED)
    client = redis.Redis.from_url(redis_url)
    async with open_redis_executor(redis_url, queue=QUEUE, secret=SECRET, timeout_s=30) as ex:
        for round_ in range(3):
            x = Parameter(float(round_), role="x")
            await backward(F.Double.apply(x), executor=ex)
            assert x.grad is not None and x.grad.data == 2.0
            client.script_flush()
        assert ex.stats.completed == 3
    keys_ran = list(client.scan_iter(match=f"asyncgraph:{{{QUEUE}}}:ran:*"))
    assert len(keys_ran) == 3  # every task's memory, whichever way it was claimed
    client.close()
