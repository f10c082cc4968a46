"""Which workers are alive: one answer, read from the workers' heartbeat hash.

Each worker writes ``HSET <workers hash> <consumer> <expiry>``, the expiry in ms of the
Redis server's clock, every heartbeat; a worker is alive while its expiry is ahead of
Redis's ``TIME``. The status command, the timeout diagnosis, the fleet helpers and the
workers' own housekeeping all read it through ``live_consumers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["live_consumers", "redis_time_ms"]


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
