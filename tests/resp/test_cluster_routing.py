"""Redis Cluster routing without a cluster: hash slots, the key of each command, units."""

from __future__ import annotations

import pytest

from asyncgraph.resp import Connection, Pool, ReplyError, parse_redis_url
from asyncgraph.resp._cluster import _redirect, _units, command_key, key_slot


def test_key_slot_matches_redis() -> None:
    # Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
    assert key_slot("123456789") == 12739
    assert key_slot("foo") == 12182
    assert key_slot(b"foo") == 12182
    # Only the first non-empty {...} counts.
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == key_slot("foo{}{bar}") != key_slot("bar")
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")
    assert key_slot("foo{bar}{zap}") == key_slot("bar")
    # All the keys of one queue share a slot.
    from asyncgraph.distributed.wire import _keys as keys

    queue_keys = [keys.task_stream("q1"), keys.dead_stream("q1"), keys.workers_hash("q1")]
    assert len({key_slot(k) for k in queue_keys}) == 1


@pytest.mark.parametrize(
    ("command", "key"),
    [
        (["GET", "a"], b"a"),
        (["XADD", "s", "*", "f", "v"], b"s"),
        (["XREADGROUP", "GROUP", "g", "c", "COUNT", 5, "BLOCK", 10, "STREAMS", "s", ">"], b"s"),
        (["XREAD", "BLOCK", 10, "STREAMS", "r", "0-0"], b"r"),
        (["EVALSHA", "abc", 2, "k1", "k2", "arg"], b"k1"),
        (["EVAL", "return 1", 0], None),
        (["XINFO", "STREAM", "s"], b"s"),
        (["XGROUP", "CREATE", "s", "g", "$", "MKSTREAM"], b"s"),
        (["PING"], None),
        (["INFO", "server"], None),
        (["MULTI"], None),
        ([b"time"], None),
    ],
)
def test_command_key(command: list[object], key: bytes | None) -> None:
    assert command_key(command) == key  # type: ignore[arg-type]


def test_units_keep_transactions_whole_and_keyless_commands_with_their_neighbours() -> None:
    a, b = key_slot("{a}"), key_slot("{b}")
    commands = [
        ["TIME"],
        ["HGETALL", "{a}:w"],
        ["MULTI"],
        ["XADD", "{b}:r", "*", "f", "v"],
        ["XACK", "{b}:t", "g", "1-0"],
        ["EXEC"],
        ["PING"],
    ]
    assert _units(commands) == [(0, 1, a), (1, 2, a), (2, 6, b), (6, 7, b)]
    assert _units([["PING"], ["TIME"]]) == [(0, 1, None), (1, 2, None)]


def test_a_transaction_across_slots_is_refused_with_the_remedy() -> None:
    with pytest.raises(ValueError, match="hash tag"):
        _units([["MULTI"], ["SET", "{a}", 1], ["SET", "{b}", 2], ["EXEC"]])


def test_redirect_is_found_inside_an_aborted_transaction() -> None:
    moved = ReplyError("MOVED 3999 127.0.0.1:7002")
    assert _redirect([b"OK", moved, ReplyError("EXECABORT Transaction discarded")]) is moved
    assert _redirect([b"OK", ReplyError("WRONGTYPE no")]) is None


def test_cluster_urls() -> None:
    address = parse_redis_url("redis+cluster://user:pw@10.0.0.1:7000,[::1]:7001")
    assert address.cluster == (("10.0.0.1", 7000), ("::1", 7001))
    assert (address.username, address.password) == ("user", "pw")
    assert "pw" not in address.display
    tls = parse_redis_url("rediss+cluster://h:7000/0?ssl_cert_reqs=none")
    assert tls.ssl_context is not None and tls.cluster == (("h", 7000),)
    for bad in ("redis+cluster://", "redis+cluster://h:7000/1", "redis+cluster://h:x"):
        with pytest.raises(ValueError, match="invalid Redis URL"):
            parse_redis_url(bad)


@pytest.mark.anyio
async def test_a_cluster_is_routed_by_the_pool_and_not_opened_as_one_node() -> None:
    """The pool chooses, when it is made, how it connects: a cluster's router or one node."""
    address = parse_redis_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
    pool = Pool(address, timeout_s=1)
    assert pool.router is not None and pool.router.address is address
    assert Pool(parse_redis_url("redis://127.0.0.1:7000"), timeout_s=1).router is None
    with pytest.raises(ValueError, match=r"a Redis Cluster.*Pool\(address\)\.connect\(\)"):
        await Connection.open(address, 1.0)  # never the address's unused host and port
