"""``asyncgraph status`` against a real fleet: workers, queue, an injected dead letter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anyio
import pytest
import redis
from agdist_helpers import StartWorker, wait_until

from asyncgraph.distributed.wire import _keys as keys

QUEUE = "status"


def status(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncgraph", "status", "--redis", url, "--queue", QUEUE, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.anyio
async def test_status_shows_the_workers_and_a_dead_letter(
    redis_url: str, start_worker: StartWorker
) -> None:
    start_worker(redis_url, QUEUE, "--concurrency", "7")
    start_worker(redis_url, QUEUE, "--concurrency", "7")
    client = redis.Redis.from_url(redis_url)
    # A message no worker can read: dead-lettered as malformed.
    client.xadd(keys.task_stream(QUEUE), {b"m": b"\xc1 not msgpack"})
    await wait_until(lambda: client.xlen(keys.dead_stream(QUEUE)) >= 1)
    client.close()

    done = status(redis_url, "--json")
    assert done.returncode == 0, done.stderr
    reading = json.loads(done.stdout)
    assert reading["alive"] == 2 and len(reading["workers"]) == 2
    for worker in reading["workers"]:
        assert worker["alive"] and worker["concurrency"] == 7 and worker["draining"] is False
        assert isinstance(worker["pid"], int) and worker["host"] and worker["version"]
        assert worker["in_flight"] == 0
    assert reading["dead_letters"] == 1
    assert reading["latest_dead_letters"][0]["reason"] == "malformed"
    assert reading["pending"] == 0 and reading["depth"] == 0  # dead-lettered, then removed

    text = status(redis_url)
    assert text.returncode == 0, text.stderr
    assert f"queue '{QUEUE}'" in text.stdout and "2 worker(s) alive" in text.stdout
    assert text.stdout.count("0/7 in flight") == 2
    assert "dead letters: 1" in text.stdout and "malformed" in text.stdout


def test_status_of_an_unknown_queue_or_an_unreachable_redis_is_clear(redis_url: str) -> None:
    unknown = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "status", "--redis", redis_url, "--queue", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 1
    assert "queue 'nope'" in unknown.stdout and "unknown" in unknown.stdout
    down = status("redis://127.0.0.1:1/0")
    assert down.returncode == 1
    assert down.stderr.startswith("error: ") and "check --redis" in down.stderr
    assert "Traceback" not in down.stderr


def test_a_wrong_password_is_one_clear_line_that_does_not_show_the_password(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.acl_setuser(
        "statususer", enabled=True, passwords=["+right-password"], commands=["+@all"], keys=["*"]
    )
    try:
        host = redis_url.split("//", 1)[1].split("/", 1)[0]
        done = status(f"redis://statususer:wrong-password@{host}/0")
        assert done.returncode == 1
        assert done.stderr.startswith("error: Redis at redis://statususer:***@")
        assert "WRONGPASS" in done.stderr and "check the user name and password" in done.stderr
        assert "Traceback" not in done.stderr and "wrong-password" not in done.stderr
        # The password in the query (redis-py's form) and in the environment variable.
        env = {
            **os.environ,
            "ASYNCGRAPH_REDIS_URL": f"redis://statususer@{host}/0?password=right-password",
        }
        for extra in (["--json"], []):
            shown = subprocess.run(
                [sys.executable, "-m", "asyncgraph", "status", "--queue", QUEUE, *extra],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            assert shown.returncode == 1  # an unknown queue, read with the right password
            assert "password=***" in shown.stdout
            assert "right-password" not in shown.stdout + shown.stderr
    finally:
        client.acl_deluser("statususer")
        client.close()


def test_escape_sequences_stored_in_redis_are_shown_escaped(redis_url: str) -> None:
    # Anyone who can write to Redis chooses what status prints: a worker entry of theirs.
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    expiry = seconds * 1000 + micros // 1000 + 60_000
    host = "evil\x1b]0;pwned\x07\x1b[2J\r\u009b2Jhost"
    client.hset(keys.workers_hash(QUEUE), "w\x1b[31m1", expiry)
    client.hset(keys.workers_info_hash(QUEUE), "w\x1b[31m1", json.dumps({"host": host}))
    client.close()
    text = status(redis_url)
    assert "\x1b" not in text.stdout and "\x07" not in text.stdout and "\r" not in text.stdout
    assert "\u009b" not in text.stdout  # a C1 control (CSI on some terminals) too
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\x9b2Jhost" in text.stdout
    assert "w\\x1b[31m1" in text.stdout


@pytest.mark.anyio
async def test_the_rate_counts_settled_tasks_on_every_redis_version(
    redis_server_url: str, shared_fleet: str
) -> None:
    # Redis 6.2 (the oldest supported, bundled for the tests) has no entries-read in
    # XINFO GROUPS: the rate comes from what each worker says it settled.
    import agdist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.distributed._status import fleet_status

    async def settled() -> int:
        reading = await fleet_status(redis_server_url, shared_fleet)
        return sum(w["settled"] for w in reading["workers"])

    before = await settled()
    leaves = [Parameter(float(i)) for i in range(64)]
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward([F.Noop.apply(p) for p in leaves], executor=ex)
    with anyio.fail_after(120):  # workers publish their count with their heartbeat
        while await settled() < before + 64:  # noqa: ASYNC110 (a poll of Redis)
            await anyio.sleep(0.1)
    assert await settled() == before + 64


@pytest.mark.anyio
async def test_every_reading_while_tasks_flow_shows_their_rate(
    redis_server_url: str, shared_fleet: str
) -> None:
    # The issue: `status --watch` read 0.0 tasks/s with 64 tasks in flight. Each worker
    # publishes what it settled per second since its previous status, so any reading taken
    # while tasks flow shows a rate, however its interval falls against the heartbeats.
    import agdist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.distributed._status import fleet_status

    chains = []
    for i in range(8):
        node = Parameter(float(i))
        # 8 tasks settled every 50 ms for 30 s at best: they still flow when the readings
        # end, however slowly a loaded machine runs them; the pass is cancelled then.
        for _ in range(600):
            node = F.Nap.apply(node, 0.05)
        chains.append(node)
    rates: list[float] = []
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=120) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: backward(chains, executor=ex))
            with anyio.fail_after(120):  # a deadline: the first status of the pass shows it
                while not (await fleet_status(redis_server_url, shared_fleet))["tasks_per_s"]:  # noqa: ASYNC110 (a poll of Redis)
                    await anyio.sleep(0.1)
            for _ in range(6):
                rates.append((await fleet_status(redis_server_url, shared_fleet))["tasks_per_s"])
                await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
    # Every reading shows the flow (about 160 a second on an idle machine, its speed is the
    # machine's), none the 0.0 tasks/s of the issue.
    assert all(rate > 0 for rate in rates), rates


def test_malformed_worker_entries_are_marked_and_the_rest_shown(
    redis_url: str, start_worker: StartWorker
) -> None:
    # Anyone who can write to Redis can leave a bad entry: one of them used to end the
    # reading (a ValueError for the whole queue, or a traceback). Each is marked instead.
    start_worker(redis_url, QUEUE, "--concurrency", "7")
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    expiry = seconds * 1000 + micros // 1000 + 60_000
    good_info = json.dumps({"host": "h", "pid": 1, "concurrency": 2, "in_flight": 0})
    bad = {
        "bad-beat": ("soon", good_info),
        "huge-beat": ("9" * 4000, good_info),
        "float-beat": ("1e400", good_info),
        "list-info": (expiry, json.dumps([1, 2])),
        "not-json": (expiry, "{"),
        "bad-types": (
            expiry,
            json.dumps(
                {
                    "host": {"a": 1},
                    "pid": "x",
                    "concurrency": [],
                    "in_flight": -1.5,
                    "abandoned": "many",
                    "settled": True,
                    "settled_per_s": "fast",
                    "version": 3,
                    "draining": "yes",
                    "started": "today",
                }
            ),
        ),
    }
    for name, (beat, info) in bad.items():
        client.hset(keys.workers_hash(QUEUE), name, beat)
        client.hset(keys.workers_info_hash(QUEUE), name, info)
    client.close()

    done = status(redis_url, "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    reading = json.loads(done.stdout)
    workers = {w["name"]: w for w in reading["workers"]}
    assert set(workers) == {*bad, next(n for n in workers if n not in bad)}
    (good,) = (w for name, w in workers.items() if name not in bad)
    assert good["alive"] and good["concurrency"] == 7 and good["malformed"] == []
    assert reading["alive"] == 4  # the good one, and the three whose heartbeat reads
    for name in ("bad-beat", "huge-beat", "float-beat"):
        assert workers[name]["expires_in_s"] is None and not workers[name]["alive"]
        assert workers[name]["malformed"] == ["heartbeat is not a number of ms"], name
        assert workers[name]["host"] == "h" and workers[name]["concurrency"] == 2
    assert workers["list-info"]["malformed"] == ["info is a JSON list, not an object"]
    assert workers["not-json"]["malformed"] == ["info is not JSON"]
    assert workers["list-info"]["alive"] and workers["list-info"]["host"] is None
    odd = workers["bad-types"]
    assert odd["alive"] and odd["malformed"] == [
        f"{field} is not {kind}"
        for field, kind in (
            ("host", "a text"), ("pid", "an integer"), ("concurrency", "an integer"),
            ("in_flight", "an integer"), ("abandoned", "an integer"), ("settled", "an integer"),
            ("settled_per_s", "a number"), ("version", "a text"), ("draining", "true or false"),
            ("started", "a number"),
        )
    ]  # fmt: skip
    assert all(odd[field] is None for field in ("host", "pid", "concurrency", "version"))

    text = status(redis_url)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    assert "5 worker(s) alive" not in text.stdout and "4 worker(s) alive" in text.stdout
    assert text.stdout.count("0/7 in flight") == 1  # the good worker, shown as ever
    assert "  bad-beat: malformed (heartbeat is not a number of ms), host h" in text.stdout
    assert "  list-info: alive, malformed (info is a JSON list, not an object)" in text.stdout
    assert "pid is not an integer; concurrency is not an integer" in text.stdout


def test_keys_of_the_wrong_type_are_marked_and_the_rest_shown(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    client.hset(keys.workers_hash(QUEUE), "w1", seconds * 1000 + micros // 1000 + 60_000)
    client.set(keys.workers_info_hash(QUEUE), "not a hash")
    client.rpush(keys.task_stream(QUEUE), "not a stream")
    client.set(keys.dead_stream(QUEUE), "not a stream either")
    client.close()
    done = status(redis_url, "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    reading = json.loads(done.stdout)
    assert [w["name"] for w in reading["workers"]] == ["w1"] and reading["alive"] == 1
    assert reading["depth"] is None and reading["dead_letters"] is None
    assert sorted(m.split(": WRONGTYPE ")[0] for m in reading["malformed"]) == sorted(
        [keys.workers_info_hash(QUEUE), keys.task_stream(QUEUE), keys.dead_stream(QUEUE)]
    )
    text = status(redis_url)
    assert text.returncode == 0 and "Traceback" not in text.stderr, text.stderr
    assert "1 worker(s) alive, depth ?, pending ?" in text.stdout
    assert "  w1: alive, host None" in text.stdout and "dead letters: ?" in text.stdout
    assert f"malformed: {keys.dead_stream(QUEUE)}: WRONGTYPE" in text.stdout


def test_bidi_overrides_stored_in_redis_are_shown_escaped(redis_url: str) -> None:
    # U+202E turns the rest of a line around on a terminal that renders bidi text: a
    # name could make "silent" read as "alive". Every bidi control is shown escaped.
    client = redis.Redis.from_url(redis_url)
    seconds, micros = client.time()
    expiry = seconds * 1000 + micros // 1000 + 60_000
    name = "w\u202eevil\u202c\u2066x\u2069\u200f\u061c\u2028"
    client.hset(keys.workers_hash(QUEUE), name, expiry)
    client.hset(keys.workers_info_hash(QUEUE), name, json.dumps({"version": "1\u202d2"}))
    client.close()
    text = status(redis_url)
    assert text.returncode == 0, text.stderr
    for char in "\u202e\u202c\u2066\u2069\u200f\u061c\u2028\u202d":
        assert char not in text.stdout, repr(char)
    assert "w\\u202eevil\\u202c\\u2066x\\u2069\\u200f\\u061c\\u2028: alive" in text.stdout
    assert "version 1\\u202d2" in text.stdout


def test_a_command_the_user_may_not_run_is_one_clear_line(redis_url: str) -> None:
    # Not a malformed entry: Redis refused (an ACL without HGETALL); the reading stops.
    client = redis.Redis.from_url(redis_url)
    client.acl_setuser(
        "nohgetall", enabled=True, passwords=["+pw-0123456789"], commands=["+@all", "-hgetall"],
        keys=["*"],
    )  # fmt: skip
    try:
        host = redis_url.split("//", 1)[1].split("/", 1)[0]
        done = status(f"redis://nohgetall:pw-0123456789@{host}/0")
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.startswith("error: Redis at ") and "refused: NOPERM" in done.stderr
    finally:
        client.acl_deluser("nohgetall")
        client.close()


def test_redis_comes_from_the_flag_or_the_variable_and_without_both_is_one_line(
    redis_url: str,
) -> None:
    # The issue: the usage marked --redis required although $ASYNCGRAPH_REDIS_URL gives it.
    bare = {k: v for k, v in os.environ.items() if k != "ASYNCGRAPH_REDIS_URL"}

    def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "asyncgraph", "status", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "COLUMNS": "200"},
        )

    for env in (bare, {**bare, "ASYNCGRAPH_REDIS_URL": redis_url}):
        usage = cli("-h", env=env)
        assert usage.returncode == 0 and "[--redis URL]" in usage.stdout, usage.stdout
        assert "$ASYNCGRAPH_REDIS_URL" in usage.stdout
    neither = cli("--queue", QUEUE, env=bare)
    assert neither.returncode == 2 and neither.stdout == ""
    assert neither.stderr.count("\n") == 1 and "Traceback" not in neither.stderr
    assert neither.stderr.startswith("error: no Redis to read: pass --redis URL or set ")
    assert "$ASYNCGRAPH_REDIS_URL" in neither.stderr
    # The variable alone reads the fleet (an unknown queue: exit 1, said on stdout).
    from_env = cli("--queue", "nope", env={**bare, "ASYNCGRAPH_REDIS_URL": redis_url})
    assert from_env.returncode == 1 and "queue 'nope'" in from_env.stdout, from_env.stderr
    # The flag wins over the variable.
    both = cli("--redis", redis_url, "--queue", "nope", env={**bare, "ASYNCGRAPH_REDIS_URL": "x"})
    assert both.returncode == 1 and "queue 'nope'" in both.stdout, both.stderr
