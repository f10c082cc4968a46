"""The small RESP client, against the real Redis of the suite."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph.resp import (
    Oversize,
    Pool,
    RedisConnectionLost,
    ReplyError,
    Wide,
    parse_redis_url,
    redact_url,
)
from asyncgraph.resp._hiredis_protocol import _HIREDIS_REPLY_LIMIT, _HiredisReader, pack
from asyncgraph.resp._protocol import MORE, Reader, encode

pytestmark = pytest.mark.anyio
sys.path.insert(0, str(Path(__file__).resolve().parent))


async def test_commands_pipelines_and_errors(redis_url: str) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=2)
    try:
        big = b"\x00\r\n" * 200_000
        assert await pool.execute("SET", "k", big) == b"OK"
        assert await pool.execute("GET", "k") == big
        replies = await pool.pipeline(
            [
                ["INCR", "n"],
                ["INCRBYFLOAT", "f", 0.5],
                ["NOPE"],
                ["GET", "missing"],
                ["XRANGE", "s", "-", "+"],
            ]
        )
        assert replies[:2] == [1, b"0.5"]
        assert isinstance(replies[2], ReplyError) and replies[2].code == "ERR"
        assert replies[3:] == [None, []]
        with pytest.raises(ReplyError):
            await pool.execute("NOPE")
    finally:
        await pool.aclose()


async def test_bulk_over_the_cap_is_skipped_unread_and_the_connection_stays_usable(
    redis_url: str,
) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=5)
    big = b"\xab" * 3_000_000
    await pool.execute("DEL", "cap:s", "cap:l")
    await pool.execute("XADD", "cap:s", "*", "m", b"small", "s", b"")
    await pool.execute("XADD", "cap:s", "*", "m", big, "s", b"sig")
    await pool.execute("XADD", "cap:s", "*", "m", b"after", "s", b"")
    conn = await pool.connect()
    peak = 0
    receive = conn._stream.receive

    async def watched(max_bytes: int = 65536) -> bytes:
        nonlocal peak
        peak = max(peak, conn._reader.buffered)
        return await receive(max_bytes)

    conn._stream.receive = watched  # type: ignore[method-assign]
    try:
        (entries,) = await conn.pipeline([["XRANGE", "cap:s", "-", "+"]], max_bulk=10_000)
        assert [e[1] for e in entries] == [
            [b"m", b"small", b"s", b""],
            [b"m", Oversize(3_000_000), b"s", b"sig"],
            [b"m", b"after", b"s", b""],
        ]
        assert peak < 1_000_000  # never buffered the 3 MB value
        # The skipped bytes were consumed: the next replies on this connection are intact,
        # also when the oversize bulk ends a reply.
        (value,) = await conn.pipeline(
            [["XRANGE", "cap:s", entries[1][0], entries[1][0]]], max_bulk=10_000
        )
        assert value[0][1][1] == Oversize(3_000_000)
        assert await conn.execute("PING") == b"PONG"
        assert await conn.execute("XLEN", "cap:s") == 3
        await pool.execute("RPUSH", "cap:l", *range(50))
        with pytest.raises(RedisConnectionLost, match="array of 50 items"):
            await conn.execute("LRANGE", "cap:l", 0, -1, max_bulk=10)
        assert conn.broken
        (whole,) = await pool.pipeline([["XRANGE", "cap:s", "-", "+"]])  # no cap: all of it
        assert whole[1][1][1] == big
    finally:
        await conn.aclose()
        await pool.aclose()


async def test_cancelled_blocking_read_discards_the_connection(redis_url: str) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=2)
    conn = await pool.connect()
    with anyio.move_on_after(0.1):
        await conn.execute("XREAD", "BLOCK", 0, "STREAMS", "nothing", "$")
    assert conn.broken
    with pytest.raises(RedisConnectionLost):
        await conn.execute("PING")
    assert await pool.execute("PING") == b"PONG"
    await pool.aclose()


async def test_timeout_and_unreachable_are_connection_errors(redis_url: str) -> None:
    from asyncgraph.distributed._redis_server import free_port

    pool = Pool(parse_redis_url(redis_url), timeout_s=0.2)
    with pytest.raises(RedisConnectionLost, match="did not answer within"):
        await pool.execute("BLPOP", "never", 5)
    await pool.aclose()
    nowhere = Pool(parse_redis_url(f"redis://127.0.0.1:{free_port()}"), timeout_s=1)
    with pytest.raises(ConnectionError, match="cannot connect"):
        await nowhere.execute("PING")


async def test_acl_user_and_password_from_the_url(redis_url: str) -> None:
    admin = Pool(parse_redis_url(redis_url), timeout_s=2)
    await admin.execute("ACL", "SETUSER", "agtest", "on", ">pw-123", "~*", "+@all")
    try:
        url = redis_url.replace("redis://", "redis://agtest:pw-123@")
        pool = Pool(parse_redis_url(url), timeout_s=2)
        assert await pool.execute("ACL", "WHOAMI") == b"agtest"
        await pool.aclose()
        wrong = Pool(
            parse_redis_url(redis_url.replace("redis://", "redis://agtest:nope@")), timeout_s=2
        )
        with pytest.raises(ReplyError, match="WRONGPASS"):
            await wrong.execute("PING")
    finally:
        await admin.execute("ACL", "DELUSER", "agtest")
        await admin.aclose()


def test_urls() -> None:
    address = parse_redis_url("rediss://u:secret@example.com:6380/3?ssl_cert_reqs=none")
    assert (address.host, address.port, address.db, address.username) == (
        "example.com",
        6380,
        3,
        "u",
    )
    assert address.ssl_context is not None and "secret" not in address.display
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    with pytest.raises(ValueError):
        parse_redis_url("http://nope")


@pytest.mark.parametrize("url", ["notaurl", "http://nope", "localhost:6379"])
def test_a_url_of_no_known_scheme_names_every_scheme_accepted(url: str) -> None:
    with pytest.raises(ValueError, match="must start with one of") as caught:
        parse_redis_url(url)
    for scheme in ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://"):
        assert scheme in str(caught.value)


async def test_an_array_over_max_items_is_skipped_unbuilt_and_the_connection_stays_usable(
    redis_url: str,
) -> None:
    pool = Pool(parse_redis_url(redis_url), timeout_s=10)
    try:
        await pool.execute("DEL", "wide:s")
        await pool.execute("XADD", "wide:s", "*", "m", b"before", "s", b"")
        # One entry of 400,000 fields (the fault-injection entry of issue #11).
        pairs: list[bytes | str] = []
        for i in range(400_000):
            pairs += [b"a%d" % i, b"b"]
        await pool.execute("XADD", "wide:s", "*", *pairs)
        await pool.execute("XADD", "wide:s", "*", "m", b"after", "s", b"")
        entries = await pool.execute("XRANGE", "wide:s", "-", "+", max_bulk=10_000, max_items=32)
        assert [e[1] for e in entries] == [
            [b"m", b"before", b"s", b""],
            Wide(800_000),
            [b"m", b"after", b"s", b""],
        ]
        assert await pool.execute("PING") == b"PONG"
    finally:
        await pool.aclose()


def replies_of(
    reader: Any, chunks: list[bytes], cap: int = 10, max_items: int = 32
) -> list[object]:
    """What ``reader`` parses out of ``chunks`` fed one by one (as ``Connection._read`` does)."""
    reader.cap, reader.max_items = cap, max_items
    out: list[object] = []
    for chunk in chunks:
        reader.feed(chunk)
        while (value := reader.next_reply()) is not MORE:
            out.append(value if not isinstance(value, ReplyError) else ("err", str(value)))
    return out


@pytest.mark.parametrize("reader_class", [Reader, _HiredisReader], ids=lambda c: c.__name__)
def test_the_parser_gives_the_same_replies_whatever_the_chunk_boundaries(
    reader_class: type[Reader | _HiredisReader],
) -> None:
    wire = (
        b"*3\r\n$5\r\nhello\r\n*2\r\n:1\r\n$-1\r\n*0\r\n"
        b"+OK\r\n-ERR nope\r\n"
        b"*2\r\n$20\r\n" + b"x" * 20 + b"\r\n*40\r\n" + b":7\r\n" * 40 + b"$3\r\nend\r\n"
    )

    def replies(chunks: list[bytes]) -> list[object]:
        return replies_of(reader_class(), chunks)

    whole = replies([wire])
    assert whole == [
        [b"hello", [1, None], []],
        b"OK",
        ("err", "ERR nope"),
        [Oversize(20), Wide(40)],
        b"end",
    ]
    for size in (1, 2, 3, 5, 7, 64):
        assert replies([wire[i : i + size] for i in range(0, len(wire), size)]) == whole


def test_hiredis_hands_a_reply_that_grows_too_big_to_the_python_parser_mid_pipeline() -> None:
    """A small reply, then a big one with an oversize bulk, then a small one, in chunks of
    any size: hiredis returns the first, the Python parser reads the big one skipping the
    bulk (it is never buffered whole), hiredis takes over again for the last."""
    big = b"y" * (3 * _HIREDIS_REPLY_LIMIT)
    wire = (
        b"+first\r\n"
        b"*3\r\n$2\r\nok\r\n$%d\r\n%b\r\n:5\r\n"
        % (len(big), big)
        + b"*2\r\n$4\r\nlast\r\n$3\r\nxyz\r\n"
    )
    expected = [b"first", [b"ok", Oversize(len(big)), 5], [b"last", b"xyz"]]
    for size in (7, 4096, 262_144, len(wire)):
        reader = _HiredisReader()
        peak = 0
        out: list[object] = []
        for i in range(0, len(wire), size):
            out += replies_of(reader, [wire[i : i + size]], cap=1000)
            peak = max(peak, reader.buffered)
        assert out == expected
        assert peak <= _HIREDIS_REPLY_LIMIT + size + 16  # never the whole bulk
        assert reader._python is None  # back on hiredis


def test_hiredis_never_sees_the_header_of_a_huge_array() -> None:
    """hiredis allocates a list at its header: a million-item one goes to the Python
    parser (which skips it unbuilt), even when the header is cut between two chunks."""
    items = 1_000_000
    wire = b":1\r\n*%d\r\n" % items + b":7\r\n" * items + b"+after\r\n"
    for cut in (5, 7, 9, 11):  # inside the header, and around it
        reader = _HiredisReader()
        chunks = [wire[:cut]] + [wire[i : i + 65536] for i in range(cut, len(wire), 65536)]
        assert replies_of(reader, chunks, cap=10_000_000) == [1, Wide(items), b"after"]


async def test_pooled_connections_the_network_dropped_silently_are_replaced_at_once(
    redis_url: str,
) -> None:
    """Issue #11 point 3: half-open connections cost one timeout, never a failed call."""
    from blackhole import BlackholeProxy

    address = parse_redis_url(redis_url)
    proxy = BlackholeProxy(address.host, address.port)
    pool = Pool(parse_redis_url(f"redis://127.0.0.1:{proxy.port}/0"), timeout_s=5)
    try:
        async with anyio.create_task_group() as tg:  # several idle connections in the pool
            for _ in range(4):
                tg.start_soon(pool.execute, "PING")
        assert len(pool._idle) >= 2
        proxy.blackhole()  # every pooled connection now hangs
        started = anyio.current_time()
        for _ in range(3):
            assert await pool.execute("PING") == b"PONG"
        # One timeout (5 s), then fresh connections: not one per pooled connection (15 s).
        assert anyio.current_time() - started < 12
    finally:
        await pool.aclose()
        proxy.close()


@pytest.mark.slow
async def test_a_reply_that_keeps_arriving_is_read_past_the_deadline_and_a_silence_is_not(
    redis_url: str,
) -> None:
    """Issue #38: the deadline bounds how long Redis stays silent, not how long a reply takes
    to read. A worker that parsed an entry of 400,000 fields on a loaded machine for longer
    than its 5 s cut that read each time, and never got past the entry."""
    from blackhole import BlackholeProxy

    address = parse_redis_url(redis_url)
    direct = Pool(address, timeout_s=5)
    proxy = BlackholeProxy(address.host, address.port)
    pool = Pool(parse_redis_url(f"redis://127.0.0.1:{proxy.port}/0"), timeout_s=2)
    try:
        big = b"x" * (2 * 1024 * 1024)
        await direct.execute("SET", "big", big)
        assert await pool.execute("PING") == b"PONG"  # a pooled connection, and a new one:
        proxy.throttle(32 * 1024, 0.05)  # 64 pieces: 3.2 s at least, none 2 s after the last
        started = anyio.current_time()
        assert await pool.execute("GET", "big") == big
        assert await pool.pipeline([["GET", "big"], ["PING"]]) == [big, b"PONG"]
        assert anyio.current_time() - started > 2 * 3.2  # the premise: each call took longer
        assert proxy.accepted == 1  # neither was cut (and sent again on a new connection)
        proxy.throttle(32 * 1024, 3.0)  # a silence of 3 s within the reply
        with pytest.raises(RedisConnectionLost, match="did not answer within 2s"):
            await pool.execute("GET", "big")
    finally:
        await pool.aclose()
        await direct.aclose()
        proxy.close()


def test_a_sentinel_url_names_its_sentinels_service_db_and_hides_its_passwords() -> None:
    address = parse_redis_url(
        "redis+sentinel://user:pw@10.0.0.1:26379,sentinel-b:26380/mymaster/2?sentinel_password=sp"
    )
    assert address.sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26380))
    assert (address.service, address.db, address.username, address.password) == (
        "mymaster",
        2,
        "user",
        "pw",
    )
    assert address.sentinel_password == "sp"
    assert "pw" not in address.display and "sp" not in address.display
    for bad in (
        "redis+sentinel://10.0.0.1:26379",  # no service
        "redis+sentinel://10.0.0.1/mymaster",  # no port
        "redis+sentinel://10.0.0.1:26379/mymaster/db0",
    ):
        with pytest.raises(ValueError, match="sentinel"):
            parse_redis_url(bad)


def test_commands_are_packed_the_same_by_hiredis_and_by_the_python_encoder() -> None:
    commands: list[list[object]] = [
        ["PING"],
        ["XADD", "s:{q}", "*", "m", b"\x00\xff" * 3000, "s", b""],
        ["SET", "k", "héllo", 7, -3, 2.5, 0.1],
        ["SET", "flag", True],  # hiredis refuses bools: the Python encoder takes it
    ]
    python: list[bytes] = []
    for command in commands:
        encode(command, python)  # type: ignore[arg-type]
    assert pack(commands) == b"".join(python)  # type: ignore[arg-type]


@pytest.fixture
def proxy(redis_url: str) -> Any:
    """A proxy to the suite's Redis that can lose a reply (``blackhole.BlackholeProxy``)."""
    from blackhole import BlackholeProxy

    address = parse_redis_url(redis_url)
    proxy = BlackholeProxy(address.host, address.port)
    yield proxy
    proxy.close()


async def test_a_write_not_safe_to_repeat_whose_reply_is_lost_is_not_sent_again(
    redis_url: str, proxy: Any
) -> None:
    """Issue #23 point 8: INCR and XADD * ran once, and the lost reply is an error."""
    pool = Pool(parse_redis_url(f"redis://127.0.0.1:{proxy.port}/0"), timeout_s=2)
    direct = Pool(parse_redis_url(redis_url), timeout_s=2)
    try:
        assert await pool.execute("PING") == b"PONG"  # a pooled connection
        for command in (["INCR", "n"], ["XADD", "s", "*", "f", "v"]):
            proxy.drop_next_reply()
            with pytest.raises(
                RedisConnectionLost, match=f"connection closed \\(not sent again: {command[0]} may"
            ):
                await pool.execute(*command)
            assert await pool.execute("PING") == b"PONG"  # a new pooled connection
        assert await direct.execute("GET", "n") == b"1"
        assert await direct.execute("XLEN", "s") == 1
        assert proxy.accepted == 3  # the first, and one after each loss: nothing re-sent
        # A pipeline is sent again only if all of it is safe.
        proxy.drop_next_reply()
        with pytest.raises(RedisConnectionLost, match="INCR may have run"):
            await pool.pipeline([["GET", "n"], ["INCR", "n"]])
        assert await direct.execute("GET", "n") == b"2"
    finally:
        await pool.aclose()
        await direct.aclose()


async def test_a_safe_command_whose_reply_is_lost_is_sent_again_and_the_caller_decides(
    redis_url: str, proxy: Any
) -> None:
    pool = Pool(parse_redis_url(f"redis://127.0.0.1:{proxy.port}/0"), timeout_s=2)
    try:
        assert await pool.execute("SET", "k", "v") == b"OK"
        proxy.drop_next_reply()
        replies = await pool.pipeline([["GET", "k"], ["HSET", "h", "f", 1], ["DEL", "x"]])
        # The repeat's HSET adds no field: the first run did (a count may be lower).
        assert replies == [b"v", 0, 0]
        assert await pool.execute("HGETALL", "h") == [b"f", b"1"]
        assert proxy.accepted == 2  # sent again on a new connection
        # retry=False: never sent again.
        proxy.drop_next_reply()
        with pytest.raises(RedisConnectionLost, match="the caller asked for no retry"):
            await pool.execute("GET", "k", retry=False)
        # retry=True: the caller vouches for a repeat (INCR here runs twice: its promise).
        assert await pool.execute("PING") == b"PONG"
        proxy.drop_next_reply()
        assert await pool.execute("INCR", "n", retry=True) == 2
        assert proxy.accepted == 4  # one more for the PING, one for the repeat
    finally:
        await pool.aclose()


async def test_a_write_not_safe_to_repeat_on_a_silently_dead_connection_is_not_sent_again(
    redis_url: str, proxy: Any
) -> None:
    """A NAT that forgot the connection: the call times out once and is not repeated."""
    pool = Pool(parse_redis_url(f"redis://127.0.0.1:{proxy.port}/0"), timeout_s=0.3)
    try:
        assert await pool.execute("PING") == b"PONG"
        proxy.blackhole()
        with pytest.raises(RedisConnectionLost, match=r"did not answer within 0.3s \(not sent"):
            await pool.execute("RPUSH", "l", "x")
        assert proxy.accepted == 1
        assert await pool.execute("LLEN", "l") == 0  # swallowed on its way: never ran
    finally:
        await pool.aclose()


def test_an_addresss_repr_holds_no_password() -> None:
    for url in (
        "redis://u:resp-pass-1@h:1/0?password=resp-pass-2",
        "redis+sentinel://:resp-pass-1@a:1,b:2/svc?sentinel_password=resp-pass-3",
    ):
        address = parse_redis_url(url)
        assert address.password and "resp-pass" not in repr(address)
