"""Everything the fleet keeps in Redis and reads back is sealed (issue #33).

NOTE [Sealed records] in ``asyncgraph.distributed.wire._signing``: a record the fleet
reads back carries an HMAC bound to its key and field (``Signer.seal``), and its reader
unseals it (``Signer.unseal``). This test runs a signed fleet through a task's first run,
a worker's death and the rerun (so the journal is written and replayed, and the replay
memory claimed and marked), snapshots every key of the queue while the task is held and
after, and requires each value of each key to unseal under that key and field, unless
the key is one of the few kinds that are unsealed by design (``UNSEALED``, each with why
a forged value cannot make the fleet use a forged answer, result or record).

A new kind of record therefore fails here until it is written with ``seal`` (and then,
being stored as ``hmac1:<mac>:<payload>``, it cannot be used by a reader that does not
``unseal`` it), or added to ``UNSEALED`` with a reason a reviewer can judge.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
from agdist_helpers import SECRET, NumberedServer, StartWorker, kill_after_the_call_then_rerun

from asyncgraph.distributed.wire._signing import SEALED, Signer
from asyncgraph.models._journal import decode_record

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

Q = r"asyncgraph:\{[^}]+\}"
ID = "[0-9a-f]{32}"
# The keys of a queue read back without a seal, and why that is safe. Streams are not
# records: every task, reply and cancellation in them is signed as a message.
UNSEALED: dict[str, str] = {
    rf"{Q}:workers": "heartbeats: a forged one delays or hastens a reclaim, whose rerun "
    "the journal and the replay memory make safe",
    rf"{Q}:workers:info": "what `asyncgraph status` shows of each worker: display only",
    rf"{Q}:client:{ID}": "a client's heartbeat: a forged one runs or skips its tasks",
    rf"{Q}:ran:{ID}:\d+:\d+": "the replay memory's marks (bits): a forged bit refuses a "
    "task, a cleared one lets a replay run (the ACL keeps ran:* from clients' users)",
}
UNSEALED_FIELDS: dict[str, set[bytes]] = {
    # The journal's byte count, a bound: a forged value keeps fewer answers (paid again).
    rf"{Q}:calls:{ID}:[0-9a-f]+": {b"#bytes"},
}


def records(client: redis.Redis, queue: str) -> dict[tuple[bytes, bytes], bytes]:
    """Every (key, field) -> value of the queue's keys that are not streams (``b""``: the
    field of a string key)."""
    found: dict[tuple[bytes, bytes], bytes] = {}
    for key in client.scan_iter(match=f"asyncgraph:{{{queue}}}:*"):
        kind = client.type(key)
        if kind == b"hash":
            for field, value in client.hgetall(key).items():
                found[key, field] = value
        elif kind == b"string":
            found[key, b""] = client.get(key)
        elif kind != b"stream":
            found[key, b"?"] = kind  # a new type: fails below unless declared
    return found


def unsealed(found: dict[tuple[bytes, bytes], bytes], signer: Signer) -> list[str]:
    """The records that do not unseal under their key and field, and are not declared."""
    bad = []
    for (key, field), value in found.items():
        name = key.decode()
        if any(re.fullmatch(p, name) for p in UNSEALED):
            continue
        if any(re.fullmatch(p, name) and field in f for p, f in UNSEALED_FIELDS.items()):
            continue
        if not value.startswith(SEALED) or signer.unseal(key, field, value) is None:
            bad.append(f"{name} {field!r}: {value[:40]!r}")
    return bad


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # what Redis holds, not the loop
async def test_every_record_the_fleet_reads_back_is_sealed(
    redis_url: str, start_worker: StartWorker
) -> None:
    queue, signer, snapshots = "sealed", Signer(SECRET), []

    def snapshot(admin: redis.Redis) -> None:  # while the killed worker's task is held
        snapshots.append(records(admin, queue))

    with NumberedServer() as server:
        _, spent = await kill_after_the_call_then_rerun(
            redis_url, start_worker, server, queue, "sealed", tamper=snapshot, secret=SECRET
        )
        assert spent.replayed == 1  # the journal was written and read back
    admin = redis.Redis.from_url(redis_url)
    try:
        snapshots.append(records(admin, queue))
        written = {k.decode() for found in snapshots for k, _ in found}
        # The records this run wrote: the journal, the replay memory's claim and its mark.
        for kind in (rf"{Q}:calls:{ID}:[0-9a-f]+", rf"{Q}:ran:{ID}:\d+", rf"{Q}:ran:{ID}:\d+:\d+"):
            assert any(re.fullmatch(kind, key) for key in written), (kind, written)
        for found in snapshots:
            assert unsealed(found, signer) == []
        # Sealed, a record is unusable to a reader that does not unseal it.
        journal = [v for (k, f), v in snapshots[-1].items() if b":calls:" in k and f != b"#bytes"]
        assert journal and all(decode_record(v) is None for v in journal)
        assert all(
            decode_record(signer.unseal(k, f, v))
            for (k, f), v in snapshots[-1].items()
            if v in journal
        )

        # A new kind of record written without a seal is caught; sealed, it passes.
        new_key = f"asyncgraph:{{{queue}}}:results:{'ab' * 16}:1f"
        admin.hset(new_key, "1f", b'{"grad": 1.0}')
        assert unsealed(records(admin, queue), signer) == [f"{new_key} b'1f': b'{{\"grad\": 1.0}}'"]
        admin.hset(new_key, "1f", signer.seal(new_key, "1f", b'{"grad": 1.0}'))
        assert unsealed(records(admin, queue), signer) == []
        # ... but not moved to another field or key.
        admin.hset(new_key, "20", signer.seal(new_key, "1f", b'{"grad": 1.0}'))
        assert len(unsealed(records(admin, queue), signer)) == 1
    finally:
        admin.close()


def test_the_declared_exceptions_are_what_the_fleet_writes() -> None:
    # Each pattern names keys the fleet really writes (a stale entry would hide a record).
    from asyncgraph.distributed.wire import _keys as keys

    c, q = "ab" * 16, "q"
    written: list[Any] = [
        keys.workers_hash(q),
        keys.workers_info_hash(q),
        keys.client_key(q, c),
        keys.ran_answered_key(q, c, 17, 3),
    ]
    for pattern, name in zip(UNSEALED, written, strict=True):
        assert re.fullmatch(pattern, name), (pattern, name)
    (pattern,) = UNSEALED_FIELDS
    assert re.fullmatch(pattern, keys.calls_key(q, c, "1f"))
    # ... and no sealed record falls under them.
    assert not any(re.fullmatch(p, keys.ran_claims_key(q, c, 17)) for p in UNSEALED)


async def test_a_replay_claim_that_does_not_verify_is_ignored_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A claim in the replay memory read back (HGET) that does not unseal: the task is not
    # run on its word, the worker logs it and counts it, as the journal's records, and
    # answers its client with an error naming the claim (no wait for its whole timeout).
    import time

    from asyncgraph.distributed import Worker, WorkerConfig
    from asyncgraph.distributed.wire import _keys as keys
    from asyncgraph.distributed.wire._schema import TaskMessage, decode, encode
    from asyncgraph.distributed.worker._registry import build_registry

    signer = Signer(SECRET)
    registry = build_registry(["agdist_functions"])
    worker = Worker(WorkerConfig("redis://127.0.0.1:1/0", queue="q", secret=SECRET), registry)
    worker._writer.batching = True  # no Redis: the task is taken by hand, nothing is sent
    (name, function), *_ = registry.items()
    message = TaskMessage(
        *("q", "c" * 32, "1", name, function.fingerprint, "backward", 5000, {}),
        expiry_ms=int(time.time() * 1000) + 5000,
    )
    packed, signature = encode(message, signer)
    series = 'asyncgraph_worker_ignored_records_total{record="replay"}'
    assert f"{series} 0" in worker.metrics.render()
    async with worker._ctx.slots.runner.serving():
        taken = worker._tasks.admit(
            b"1-0", [keys.F_MESSAGE, packed, keys.F_SIGNATURE, signature], 1
        )
        assert taken is not None
        held, admitted = taken
        with caplog.at_level("WARNING", "asyncgraph.distributed.worker"):
            worker._tasks.start_held(held, admitted, b"1-0")  # the right id, unsealed
    assert ("c" * 32, "1") not in worker._ctx.slots.running
    assert f"{series} 1" in worker.metrics.render()
    assert "does not verify" in caplog.text
    (settled,) = worker._writer._outgoing
    assert (settled.client, settled.task_id, settled.outcome) == ("c" * 32, "1", "replayed")
    (sent,) = [c for c in settled.commands if c[0] == "XADD" and c[1] == settled.reply_stream]
    fields = dict(zip(sent[3::2], sent[4::2], strict=True))  # XADD stream * k v k v ...
    reply = decode(fields[keys.F_MESSAGE], fields[keys.F_SIGNATURE], signer, "q")
    assert reply.error is not None and reply.error.kind == "dead_letter", reply
    assert "claim in the replay memory that does not verify" in reply.error.message
    assert any(c[1] == keys.dead_stream("q") for c in settled.commands)  # and dead-lettered
