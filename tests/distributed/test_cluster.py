"""Redis Cluster (issue #15 point 2): queues spread over the masters; MOVED and ASK followed.

Real processes on loopback: three masters of one cluster. Queues whose hash slots fall on
different masters are served at once; the slot of one queue is resharded to another
master (keys moved one by one, so clients see ASK, TRYAGAIN, then MOVED) while a pass
runs on it. The pass completes with the gradients of a local run and the next passes
run on the new owner, served by the same workers.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import agdist_functions as F
import anyio
import pytest
import redis
from agdist_helpers import StartWorker, check_limiter_and_cache, documented_acl_roles

from asyncgraph import Parameter, backward
from asyncgraph.distributed import open_redis_executor, wait_for_workers
from asyncgraph.distributed._redis_server import find_redis_server, free_port
from asyncgraph.models._keys import cache_key
from asyncgraph.resp import Pool, parse_redis_url
from asyncgraph.resp._cluster import key_slot

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


def wait(predicate: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class Cluster:
    """Three masters, the 16,384 slots split in three ranges, no replicas."""

    def __init__(self, directory: Path) -> None:
        binary = find_redis_server()
        self.ports = [cluster_port() for _ in range(3)]
        self.procs = []
        for port in self.ports:
            node_dir = directory / str(port)
            node_dir.mkdir()
            with (node_dir / "log").open("wb") as log:
                self.procs.append(self._start(binary, port, node_dir, log))
        self.binary, self.directory = binary, directory
        self.clients = [redis.Redis(port=p, socket_timeout=5) for p in self.ports]
        wait(lambda: all(self._ping(c) for c in self.clients), what="the nodes")
        self.ids = [c.execute_command("CLUSTER", "MYID").decode() for c in self.clients]
        bounds = [0, 5461, 10923, 16384]
        for i, client in enumerate(self.clients):
            client.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for client in self.clients[1:]:
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        wait(self._ready, 30, what="the cluster to agree")

    @staticmethod
    def _start(binary: str, port: int, node_dir: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(node_dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    @staticmethod
    def _ping(client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def _ready(self) -> bool:
        for client in self.clients:
            info = client.execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in info or "cluster_known_nodes:3" not in info:
                return False
            slots = client.execute_command("CLUSTER", "SLOTS")
            if sum(int(s[1]) - int(s[0]) + 1 for s in slots) != 16384 or len(slots) != 3:
                return False
        return True

    def add_master(self) -> int:
        """Start a fourth node, empty, and join it to the cluster; return its index."""
        port = cluster_port()
        node_dir = self.directory / str(port)
        node_dir.mkdir()
        with (node_dir / "log").open("wb") as log:
            self.procs.append(self._start(self.binary, port, node_dir, log))
        self.ports.append(port)
        client = redis.Redis(port=port, socket_timeout=5)
        self.clients.append(client)
        wait(lambda: self._ping(client), what="the new node")
        self.ids.append(client.execute_command("CLUSTER", "MYID").decode())
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        count = len(self.ports)

        def joined() -> bool:
            for c in self.clients:
                info = c.execute_command("CLUSTER", "INFO").decode()
                if f"cluster_known_nodes:{count}" not in info or "cluster_state:ok" not in info:
                    return False
            return True

        wait(joined, 30, what="the new node to join")
        return count - 1

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def owner(self, slot: int) -> int:
        """Index of the master serving ``slot`` (as the first node sees it)."""
        for start, stop, master, *_ in self.clients[0].execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(stop):
                return self.ports.index(int(master[1]))
        raise LookupError(slot)

    def reshard(self, slot: int, target: int, pause_s: float = 0.05) -> int:
        """Move ``slot`` to master ``target`` key by key; return how many keys moved."""
        source = self.owner(slot)
        src, dst = self.clients[source], self.clients[target]
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[target])
        moved = 0
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
            src.execute_command(
                "MIGRATE", "127.0.0.1", self.ports[target], "", 0, 5000, "KEYS", *keys
            )
            moved += len(keys)
            time.sleep(pause_s)  # clients meanwhile see some keys here, some there
        for client in (dst, src, *[c for c in self.clients if c not in (src, dst)]):
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target])
        return moved

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def cluster(tmp_path: Path, redis_server_binary: None) -> Iterator[Cluster]:
    started = Cluster(tmp_path)
    yield started
    started.stop()


def acl_log(client: Any) -> list[tuple[bytes, bytes, bytes]]:
    """``(username, reason, object)`` of each entry of one node's ACL log."""
    out = []
    for entry in client.execute_command("ACL", "LOG"):
        fields = (
            dict(zip(entry[::2], entry[1::2], strict=False)) if isinstance(entry, list) else entry
        )
        out.append((fields[b"username"], fields[b"reason"], fields[b"object"]))
    return out


def cluster_acl_rules(role: str, password: str, major: int) -> list[str]:
    """A documented ACL role plus the two rules its Redis Cluster note adds (docs/how-to/fleet.md),
    for a server of version ``major`` (6.2 has no read-only key patterns)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "fleet.md").read_text()
    assert "`+cluster|slots +asking` added to the user" in page
    documented = documented_acl_roles(major)[role]
    rules = [f">{password}" if r == ">PASSWORD" else r for r in documented]
    return [*rules, "+cluster|slots", "+asking"]


def queues_on_each_master(cluster: Cluster) -> list[str]:
    """One queue name per master, each hashed (by its {tag}) to a slot that master serves."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < 3:
        name = f"cq{i}"
        found.setdefault(cluster.owner(key_slot(name)), name)
        i += 1
    return [found[0], found[1], found[2]]


async def test_pool_follows_moved_and_ask(cluster: Cluster) -> None:
    """Plain commands, a MULTI block and a blocking read while a slot moves under them."""
    pool = Pool(parse_redis_url(cluster.url), timeout_s=5)
    try:
        keys = [f"k{{t{i}}}" for i in range(30)]
        for i, key in enumerate(keys):  # spread over all three masters
            await pool.execute("SET", key, i)
        assert {cluster.owner(key_slot(k)) for k in keys} == {0, 1, 2}
        assert await pool.pipeline([["GET", k] for k in keys]) == [
            str(i).encode() for i in range(30)
        ]
        slot = key_slot("{moving}")
        source = cluster.owner(slot)
        target = (source + 1) % 3
        for i in range(20):
            await pool.execute("SET", f"{{moving}}:{i}", i)
        done = anyio.Event()
        seen: list[Any] = []

        async def keep_using() -> None:
            n = 0
            while not done.is_set():
                replies = await pool.pipeline(
                    [
                        ["INCR", "{moving}:counter"],
                        ["MULTI"],
                        ["INCR", "{moving}:a"],
                        ["INCR", "{moving}:b"],
                        ["EXEC"],
                        ["GET", f"{{moving}}:{n % 20}"],
                    ]
                )
                seen.append(replies)
                n += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_using)
            moved = await anyio.to_thread.run_sync(lambda: cluster.reshard(slot, target))
            await anyio.sleep(0.2)
            done.set()
        assert moved >= 20
        assert pool.router is not None
        followed = pool.router.redirects
        # MOVED too, unless the map relearned after a TRYAGAIN already had the new owner
        # (Valkey's nodes learn it at once, Redis 6.2's a gossip round later): the
        # newcomer below makes a MOVED certain.
        assert followed["ASK"] and followed["TRYAGAIN"], followed
        assert cluster.owner(slot) == target
        n = len(seen)
        # Every INCR ran exactly once, the transaction whole each time, on whichever node.
        assert await pool.execute("GET", "{moving}:counter") == str(n).encode()
        assert (
            await pool.pipeline([["GET", "{moving}:a"], ["GET", "{moving}:b"]])
            == [str(n).encode()] * 2
        )
        for i, replies in enumerate(seen):
            assert replies[0] == i + 1
            assert replies[4] == [i + 1, i + 1]
            assert replies[5] == str(i % 20).encode()
        # A topology change: a new master joins and the slot moves to it; the pool's
        # connections learn of a node they never knew.
        newcomer = await anyio.to_thread.run_sync(cluster.add_master)
        await anyio.to_thread.run_sync(lambda: cluster.reshard(slot, newcomer, 0))
        moved_before = followed["MOVED"]
        assert await pool.execute("INCR", "{moving}:counter") == n + 1
        assert followed["MOVED"] > moved_before
        # A blocking read on a dedicated connection, then a value pushed from elsewhere.
        conn = await pool.connect()
        try:
            async with anyio.create_task_group() as tg:

                async def push() -> None:
                    while True:  # until the read returns: one comes after it blocked
                        await anyio.sleep(0.2)
                        await pool.execute("XADD", "{moving}:s", "*", "f", "v")

                tg.start_soon(push)
                with anyio.fail_after(120):  # a deadline, not a timing check
                    got = await conn.execute("XREAD", "BLOCK", 60000, "STREAMS", "{moving}:s", "$")
                tg.cancel_scope.cancel()
            assert got[0][0] == b"{moving}:s"
        finally:
            await conn.aclose()
    finally:
        await pool.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_queues_on_three_masters_and_a_reshard_during_a_pass(
    cluster: Cluster, start_worker: StartWorker, caplog: pytest.LogCaptureFixture
) -> None:
    # As the documented worker, client and status users, with the two rules its Cluster note adds.
    version = cluster.clients[0].info("server")["redis_version"]
    major = int(str(version).split(".")[0])
    for role in ("worker", "client", "status"):
        rules = cluster_acl_rules(role, "cluster-pw", major)
        for client in cluster.clients:
            client.execute_command("ACL", "SETUSER", f"asyncgraph-{role}", "reset", *rules)
    fleet_url = cluster.url.replace("://", "://asyncgraph-worker:cluster-pw@")
    url = cluster.url.replace("://", "://asyncgraph-client:cluster-pw@")
    queues = queues_on_each_master(cluster)
    for queue in queues:
        start_worker(fleet_url, queue, "--redis-timeout-s", "5", "--lease-ms", "2000", wait=False)
    for queue in queues:
        await anyio.to_thread.run_sync(wait_for_workers, fleet_url, queue, 1)

    # Several queues on different masters, at once.
    leaves = {q: Parameter(float(i + 1)) for i, q in enumerate(queues)}

    async def one_pass(queue: str) -> None:
        async with open_redis_executor(url, queue=queue, timeout_s=60) as ex:
            await backward(F.Scale.apply(leaves[queue], 3.0), executor=ex)

    async with anyio.create_task_group() as tg:
        for queue in queues:
            tg.start_soon(one_pass, queue)
    assert [leaves[q].grad.data for q in queues] == [3.0] * 3  # type: ignore[union-attr]

    # Reshard the first queue's slot while passes run on it, one after the other.
    queue = queues[0]
    slot = key_slot(queue)
    target = 1
    assert cluster.owner(slot) == 0
    moved: list[int] = []
    grads: list[list[float]] = []
    caplog.set_level(logging.DEBUG, logger="asyncgraph.resp")
    async with open_redis_executor(url, queue=queue, timeout_s=60) as ex:
        async with anyio.create_task_group() as tg:

            async def reshard() -> None:
                await anyio.sleep(0.3)
                moved.append(
                    await anyio.to_thread.run_sync(lambda: cluster.reshard(slot, target, 0.25))
                )

            tg.start_soon(reshard)
            while not moved or len(grads) < 3:
                nodes = [Parameter(float(i)) for i in range(8)]
                with anyio.fail_after(60):
                    await backward(
                        [F.Scale.apply(F.Nap.apply(p, 0.05), 2.0) for p in nodes], executor=ex
                    )
                grads.append([p.grad.data for p in nodes])  # type: ignore[union-attr]
    assert moved and moved[0] >= 3  # the queue's streams and hashes really moved
    assert cluster.owner(slot) == target
    assert grads == [[2.0] * 8] * len(grads)  # every pass, as a local run computes it
    # The client followed the slot to its new master (ASK and TRYAGAIN, which need
    # commands to land mid-migration, are forced in test_pool_follows_moved_and_ask).
    followed = " ".join(r.getMessage() for r in caplog.records)
    assert "following MOVED" in followed, followed[-2000:]

    # The next passes, on the new owner, with the same workers; the others unaffected.
    again = {q: Parameter(5.0) for q in queues}
    for q in queues:
        async with open_redis_executor(url, queue=q, timeout_s=30) as ex:
            with anyio.fail_after(30):
                await backward(F.Scale.apply(again[q], 2.0), executor=ex)
    assert [again[q].grad.data for q in queues] == [2.0] * 3  # type: ignore[union-attr]
    # The workers' user fills the cache; the client's reads it (and may not write it).
    await check_limiter_and_cache(fleet_url, "cluster")
    # The client's user only reads the cache, where the server can say so (Redis 7's
    # %R~; on 6.2 the page's rule is a plain ~ and the client may write it).
    if major >= 7:
        await check_limiter_and_cache(url, "cluster-c", read_only_from="cluster")
    else:
        await check_limiter_and_cache(url, "cluster-c")
    # `asyncgraph status` reads each queue on its master, the moved one on its new one.
    from asyncgraph.distributed._status import fleet_status

    status_url = cluster.url.replace("://", "://asyncgraph-status:cluster-pw@")
    for q in queues:
        status = await fleet_status(status_url, q)
        assert status["known"] and status["alive"] == 1 and status["pending"] == 0, status
    # The ACL users were never refused anything but the client's cache write above.
    refused = [line for client in cluster.clients for line in acl_log(client)]
    cache_write = [(b"asyncgraph-client", b"key", cache_key("cluster-c").encode())]
    assert refused == (cache_write if major >= 7 else []), refused
