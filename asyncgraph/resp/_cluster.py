"""Redis Cluster: route each command to the master of its key's hash slot.

``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` over TLS) names some
nodes of a cluster (the seeds). ``ClusterRouter`` learns which master serves each of
the 16,384 hash slots (``CLUSTER SLOTS``) and relearns it when the cluster says it moved
on. ``ClusterConnection`` looks like a ``Connection`` to its caller and holds one
connection per node it has talked to:

- a pipeline is cut into units (a command, or a whole ``MULTI`` ... ``EXEC``), each sent
  to the master of its slot (a keyless command goes with the keyed one before it or,
  if none, after it); units for the same node go in one write, and the replies come
  back in the caller's order;
- ``-MOVED``: the slot has a new owner for good: the map is relearned and the unit is
  sent there;
- ``-ASK``: the slot is being migrated and this key has gone ahead: the unit is sent to
  the target once, after ``ASKING``;
- ``-TRYAGAIN`` (a unit whose keys are split by a migration in progress) and
  ``-CLUSTERDOWN``: wait a moment and route the unit again.

A redirected unit was not run by the node that redirected it (a ``MULTI`` block whose
command was redirected is aborted whole), so sending it again runs it once. A lost
connection is another matter: the node may have run the unit, so it is not sent again
here; the error goes up to ``Pool.pipeline``, which repeats the whole pipeline only when
that is harmless (see ``asyncgraph.resp._idempotence``). The caller's deadline bounds the
whole exchange; redirections are also capped in number.

All the keys of a unit must share one slot: asyncgraph's keys carry a hash tag per queue
(``asyncgraph:{queue}:...``) and per rate limit, so they do.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import anyio

from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph.resp._address import RedisAddress
from asyncgraph.resp._connection import Connection, call_deadline
from asyncgraph.resp._protocol import Arg

__all__ = ["ClusterConnection", "ClusterRouter", "key_slot"]

log = logging.getLogger("asyncgraph.resp")

SLOTS = 16384
_MAX_REDIRECTS = 32
_KEYLESS = frozenset(
    {
        b"ASKING",
        b"AUTH",
        b"CLIENT",
        b"CLUSTER",
        b"COMMAND",
        b"CONFIG",
        b"DBSIZE",
        b"DISCARD",
        b"ECHO",
        b"EXEC",
        b"FLUSHALL",
        b"FLUSHDB",
        b"HELLO",
        b"INFO",
        b"KEYS",
        b"MULTI",
        b"PING",
        b"READONLY",
        b"READWRITE",
        b"ROLE",
        b"SCAN",
        b"SCRIPT",
        b"SELECT",
        b"TIME",
        b"WAIT",
    }
)


def _crc16(data: bytes) -> int:
    """CRC16-CCITT (XModem), as Redis Cluster hashes keys."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        crc &= 0xFFFF
    return crc


def key_slot(key: bytes | str) -> int:
    """The hash slot of ``key``: only the part inside its first non-empty ``{...}`` counts."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return _crc16(data) % SLOTS


def _as_bytes(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    return str(arg).encode()


def command_key(command: Sequence[Arg]) -> bytes | None:
    """The first key a command touches, or None for a command without keys."""
    if not command:
        return None
    name = _as_bytes(command[0]).upper()
    if name in _KEYLESS or len(command) < 2:
        return None
    if name in (b"XREAD", b"XREADGROUP"):
        for i, arg in enumerate(command):
            if _as_bytes(arg).upper() == b"STREAMS" and i + 1 < len(command):
                return _as_bytes(command[i + 1])
        return None
    if name in (b"EVAL", b"EVALSHA"):
        if len(command) > 3 and int(command[2]) > 0:
            return _as_bytes(command[3])
        return None
    if name in (b"XINFO", b"XGROUP", b"OBJECT", b"MEMORY"):
        return _as_bytes(command[2]) if len(command) > 2 else None
    return _as_bytes(command[1])


def _units(commands: Sequence[Sequence[Arg]]) -> list[tuple[int, int, int | None]]:
    """``(start, stop, slot)`` of each unit: one command, or a whole MULTI ... EXEC."""
    units: list[tuple[int, int, int | None]] = []
    i = 0
    while i < len(commands):
        stop = i + 1
        if commands[i] and _as_bytes(commands[i][0]).upper() == b"MULTI":
            while stop < len(commands) and not (
                commands[stop - 1] and _as_bytes(commands[stop - 1][0]).upper() == b"EXEC"
            ):
                stop += 1
        slots = {key_slot(k) for c in commands[i:stop] if (k := command_key(c)) is not None}
        if len(slots) > 1:
            raise ValueError(
                "the commands of one MULTI ... EXEC touch keys in different Redis Cluster hash "
                "slots; give their keys a common {hash tag}"
            )
        units.append((i, stop, slots.pop() if slots else None))
        i = stop
    # A keyless unit follows the keyed unit before it (or, if none, the one after it).
    resolved: list[tuple[int, int, int | None]] = []
    last: int | None = next((slot for _, _, slot in units if slot is not None), None)
    for start, stop, slot in units:
        last = slot if slot is not None else last
        resolved.append((start, stop, last))
    return resolved


def _redirect(replies: Sequence[Any]) -> ReplyError | None:
    """The redirection among a unit's replies (an EXECABORT'd block names it inside)."""
    for reply in replies:
        if isinstance(reply, ReplyError) and reply.code in (
            "MOVED",
            "ASK",
            "TRYAGAIN",
            "CLUSTERDOWN",
        ):
            return reply
    return None


def _node(error: ReplyError) -> tuple[str, int]:
    """The ``host:port`` at the end of a MOVED or ASK error."""
    where = str(error).rsplit(" ", 1)[-1]
    host, _, port = where.rpartition(":")
    return host.strip("[]"), int(port)


class ClusterRouter:
    """Which master serves which hash slot, learned from the cluster and relearned on MOVED.

    One per ``Pool``: every ``ClusterConnection`` of the pool shares it.
    """

    def __init__(self, address: RedisAddress, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._slots: list[tuple[str, int] | None] = [None] * SLOTS
        self._known: list[tuple[str, int]] = list(address.cluster)
        self._generation = 0
        self._stale = True
        self._lock: anyio.Lock | None = None
        # Redirections followed, by kind (MOVED, ASK, TRYAGAIN, CLUSTERDOWN): for tests, logs.
        self.redirects: Counter[str] = Counter()

    def node_address(self, node: tuple[str, int]) -> RedisAddress:
        host, port = node
        return replace(
            self.address,
            host=host,
            port=port,
            cluster=(),
            display=f"{host}:{port} of cluster {self.address.display}",
        )

    async def connect(self) -> ClusterConnection:
        """A connection to the cluster, once the slot map is known (the cluster answers)."""
        try:
            with anyio.fail_after(self.timeout_s):
                await self.node_for(None)
        except TimeoutError:
            raise RedisConnectionLost(
                f"Redis Cluster {self.address.display} did not answer within {self.timeout_s:g}s"
            ) from None
        return ClusterConnection(self)

    def forget(self) -> None:
        """A node went away: relearn the map before the next routing."""
        self._stale = True

    async def node_for(self, slot: int | None) -> tuple[str, int]:
        if self._stale:
            await self.refresh(self._generation)
        if slot is None:
            return self._known[0]
        node = self._slots[slot]
        if node is None:
            raise RedisConnectionLost(
                f"no master of Redis Cluster {self.address.display} serves hash slot {slot} "
                f"(the cluster is down or being reconfigured)"
            )
        return node

    async def moved(self, slot: int, node: tuple[str, int], seen: int) -> None:
        """The cluster said ``slot`` is served by ``node`` now: note it, relearn the rest."""
        self._slots[slot] = node
        await self.refresh(seen)

    @property
    def generation(self) -> int:
        return self._generation

    async def refresh(self, seen: int) -> None:
        """Learn the slot map again, unless it was relearned since generation ``seen``."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._generation != seen and not self._stale:
                return  # another task relearned it meanwhile
            errors = []
            nodes = list(dict.fromkeys([*self._known, *self.address.cluster]))
            random.shuffle(nodes)
            for node in nodes:
                try:
                    with anyio.fail_after(min(self.timeout_s, 5.0)):
                        conn = await Connection.open(self.node_address(node), self.timeout_s)
                        try:
                            reply = await conn.execute("CLUSTER", "SLOTS")
                        finally:
                            await conn.aclose()
                except (RedisConnectionLost, ReplyError, TimeoutError, OSError) as exc:
                    errors.append(f"{node[0]}:{node[1]}: {type(exc).__name__}: {exc}")
                    continue
                self._learn(reply, node)
                return
            raise RedisConnectionLost(
                f"no node of Redis Cluster {self.address.display} told its slot map: "
                + "; ".join(errors)
            )

    def _learn(self, reply: Any, asked: tuple[str, int]) -> None:
        slots: list[tuple[str, int] | None] = [None] * SLOTS
        masters: list[tuple[str, int]] = []
        for start, stop, master, *_replicas in reply:
            host = bytes(master[0]).decode() or asked[0]  # "" means the node we asked
            node = (host, int(master[1]))
            masters.append(node)
            for slot in range(int(start), int(stop) + 1):
                slots[slot] = node
        self._slots = slots
        self._known = list(dict.fromkeys(masters)) or self._known
        self._generation += 1
        self._stale = False


class ClusterConnection(Connection):
    """A ``Connection`` to a whole cluster: routes each command to the master of its slot.

    It holds one plain connection per node it has used; like a ``Connection``, it is
    used by one task at a time and is ``broken`` (closed) once any of them is cut short.
    """

    def __init__(self, router: ClusterRouter) -> None:  # no stream of its own
        self.address = router.address
        self.broken = False
        self._router = router
        self._nodes: dict[tuple[str, int], Connection] = {}
        self._last: tuple[str, int] | None = None

    async def _connection(self, node: tuple[str, int]) -> Connection:
        conn = self._nodes.get(node)
        if conn is None or conn.broken:
            conn = await Connection.open(self._router.node_address(node), self._router.timeout_s)
            self._nodes[node] = conn
        return conn

    async def pipeline(
        self,
        commands: Sequence[Sequence[Arg]],
        *,
        max_bulk: int | None = None,
        max_items: int | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        if self.broken:
            raise RedisConnectionLost(f"connection to Redis at {self.address.display} is closed")
        try:
            if timeout_s is None:
                return await self._route(commands, max_bulk, max_items)
            with call_deadline(timeout_s):
                return await self._route(commands, max_bulk, max_items)
        except BaseException as exc:
            if isinstance(exc, RedisConnectionLost):
                self._router.forget()  # a node may have gone: relearn the map
            if any(conn.broken for conn in self._nodes.values()):
                await self.aclose()
            raise

    async def _route(
        self, commands: Sequence[Sequence[Arg]], max_bulk: int | None, max_items: int | None
    ) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        # Each pending unit, with where it was told to ASK (None: its slot's master).
        pending: list[tuple[tuple[int, int, int | None], tuple[str, int] | None]] = [
            (unit, None) for unit in _units(commands)
        ]
        for attempt in range(_MAX_REDIRECTS):
            batches: dict[tuple[tuple[str, int], bool], list[tuple[int, int, int | None]]] = {}
            for unit, ask in pending:
                node = ask or (self._last if unit[2] is None and self._last else None)
                node = node or await self._router.node_for(unit[2])
                batches.setdefault((node, ask is not None), []).append(unit)
            pending = []
            wait = False
            seen = self._router.generation
            for (node, asking), units in batches.items():
                sent: list[Sequence[Arg]] = []
                for start, stop, _ in units:
                    if asking:
                        sent.append(["ASKING"])
                    sent.extend(commands[start:stop])
                got = await (await self._connection(node)).pipeline(
                    sent, max_bulk=max_bulk, max_items=max_items
                )
                self._last = node
                at = 0
                for unit in units:
                    at += asking  # the ASKING reply
                    start, stop, _ = unit
                    mine = got[at : at + stop - start]
                    at += stop - start
                    error = _redirect(mine)
                    if error is None:
                        replies[start:stop] = mine
                        continue
                    self._router.redirects[error.code] += 1
                    log.debug("Redis Cluster %s: following %s", self.address.display, error)
                    if error.code == "ASK":
                        pending.append((unit, _node(error)))
                    elif error.code == "MOVED":
                        await self._router.moved(int(str(error).split()[1]), _node(error), seen)
                        pending.append((unit, None))
                    else:  # TRYAGAIN, CLUSTERDOWN
                        wait = True
                        pending.append((unit, None))
            if not pending:
                return replies
            if wait:
                await anyio.sleep(min(0.01 * 2**attempt, 0.25))
                await self._router.refresh(self._router.generation)
        raise RedisConnectionLost(
            f"Redis Cluster {self.address.display} redirected a command {_MAX_REDIRECTS} times "
            f"(slots moving faster than they can be followed)"
        )

    async def aclose(self) -> None:
        self.broken = True
        nodes, self._nodes = self._nodes, {}
        with anyio.CancelScope(shield=True):  # a cancellation must not skip the others
            for conn in nodes.values():
                await conn.aclose()
