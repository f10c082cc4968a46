"""Who is alive: workers, read from their heartbeat hash, and clients, from their heartbeat keys.

Each worker writes ``HSET <workers hash> <consumer> <expiry>``, the expiry in ms of the
Redis server's clock, every heartbeat; a worker is alive while its expiry is ahead of
Redis's ``TIME``. The status command, the timeout diagnosis, the fleet helpers and the
workers' own housekeeping all read it through ``live_consumers``.

A client renews its key (``wire._keys.client_key``, ``SET ... PX CLIENT_TTL_MS``) every
``CLIENT_BEAT_MS``: it is alive while the key exists. Workers ask once per batch of
tasks read, and only about the clients not asked within ``ClientLiveness.recheck_s``
(see NOTE [Client liveness]).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ClientLiveness", "live_consumers", "redis_time_ms"]


def redis_time_ms(now: Any) -> int:
    """Milliseconds of a ``TIME`` reply (``[seconds, microseconds]``)."""
    return int(now[0]) * 1000 + int(now[1]) // 1000


def live_consumers(now: Any, beats: Any) -> set[bytes]:
    """The consumers whose heartbeat has not expired, from the replies to ``TIME`` and
    ``HGETALL <workers hash>``; entries that are not numbers are skipped."""
    if not isinstance(now, list) or not isinstance(beats, list):
        return set()
    now_ms = redis_time_ms(now)
    live = set()
    for i in range(0, len(beats) - 1, 2):
        try:
            if int(beats[i + 1]) >= now_ms:
                live.add(bytes(beats[i]))
        except ValueError:
            continue
    return live


class ClientLiveness:
    """What one worker knows of its clients' heartbeats: pure, its clock is given.

    NOTE [Client liveness]: a client that died (SIGKILL, a lost host) leaves its tasks
    queued, and running them would pay for model calls whose replies nobody reads. Its
    heartbeat key expires ``CLIENT_TTL_MS`` after its last beat; a worker asks
    ``EXISTS`` of the keys of the clients in a batch of tasks it read (one round trip
    for the batch, in ``worker._intake``) and admission skips the tasks of a client
    whose key is gone (outcome ``client_gone``, no reply). That a client is alive is
    reused for ``recheck_s``, so a steady stream of tasks costs one round trip per
    ``recheck_s`` per client, not one per batch, and a death is seen within
    ``CLIENT_TTL_MS + recheck_s``. That it is gone is asked again at every batch of its
    tasks: a client whose event loop stalled past ``CLIENT_TTL_MS`` (or whose Redis
    restarted empty) is taken for dead meanwhile, and its next beat renews its key,
    then sends its tasks in flight again (``_channel.TaskChannel.heartbeat``): those
    copies must run.
    """

    MAX_KNOWN = 4096  # clients remembered at most; the oldest answers are dropped first

    def __init__(self, recheck_s: float = 0.25) -> None:
        self.recheck_s = recheck_s
        self._known: dict[str, tuple[float, bool]] = {}  # client -> (asked at, alive)

    def to_ask(self, clients: Iterable[str], now: float) -> list[str]:
        """The clients among ``clients`` not known alive within the last ``recheck_s``."""
        stale = []
        for client in dict.fromkeys(clients):
            known = self._known.get(client)
            if known is None or not known[1] or now - known[0] >= self.recheck_s:
                stale.append(client)
        return stale

    def learn(self, asked: list[str], exists: list[Any], now: float) -> None:
        """Record the replies to ``EXISTS <key>`` of each client in ``asked``, in order.

        A reply that is not an integer (an error) is no answer: the client stays as it was.
        """
        for client, reply in zip(asked, exists, strict=False):
            if type(reply) is int:
                self._known.pop(client, None)  # re-inserted last: the dict stays in asking order
                self._known[client] = (now, reply > 0)
        while len(self._known) > self.MAX_KNOWN:
            del self._known[next(iter(self._known))]

    def gone(self, client: str) -> bool:
        """True if ``client``'s key was found missing when last asked; a client never asked is alive."""
        known = self._known.get(client)
        return known is not None and not known[1]
