"""The call journal: the model calls a remote task made, kept so that a rerun does not pay again.

NOTE [Call journal]: delivery to workers is at-least-once. A worker killed after a
model call returned and before the task's reply was written loses that answer, and
the task runs again on another worker: without a journal the call is made, and
billed, twice. So on the fleet, every call a task makes is recorded in Redis, in a
hash under the task's key (``TaskInfo.journal_key``: the queue's hash slot, the
client's id and the task's id), before ``complete`` returns it; a rerun of the task
(``TaskInfo.delivery`` > 1) asks the journal first and replays a recorded answer
instead of calling the model.

- A call is named by its request's digest (what the response cache hashes) and the
  occurrence of that digest in the task (the n-th identical request), not by its
  position among the task's calls: concurrent calls finish in any order, the
  requests a deterministic task issues do not change. A different request is never
  answered from the journal.
- The hash expires when the task can no longer be rerun (the client's wait,
  ``TaskInfo.rerun_s``), and holds at most ``MAX_RECORDS`` answers and
  ``MAX_TASK_BYTES`` bytes of them (an answer longer than ``MAX_RECORD_BYTES`` is not
  kept): past that, calls are made as usual and paid again on a rerun.
- Records are JSON (``Completion.to_dict``), validated on read, size-capped; a record
  that cannot be read is a miss. Nothing is unpickled.
- The journal saves money, it does not make results correct: a Redis error while
  reading or writing it is logged (logger ``asyncgraph.models``) and the call goes on
  as if there were no journal.

Each journal operation takes a connection of its own, closed before it returns (a
model call takes 100 ms or more; a connection to Redis well under one), so nothing is
left open when a task or a worker ends.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from asyncgraph._redact import redact_url
from asyncgraph.models._types import Completion

__all__ = [
    "MAX_RECORDS",
    "MAX_RECORD_BYTES",
    "MAX_TASK_BYTES",
    "CallJournal",
    "JournalStore",
    "current_journal",
    "decode_record",
    "encode_record",
    "journaling",
]

logger = logging.getLogger("asyncgraph.models")

MAX_RECORDS = 256  # answers kept per task
MAX_RECORD_BYTES = 64 * 1024  # a longer answer is not kept
MAX_TASK_BYTES = 1024 * 1024  # answers' bytes kept per task
_BYTES_FIELD = "#bytes"  # the hash's running total of record bytes (no call's name has a #)

# Keep the first answer of a call (a stalled worker and its replacement may both write),
# within the task's bounds, and expire the whole journal with the task's last chance to
# be rerun; one round trip, one key (so one slot on a Redis Cluster).
# Returns 1 (kept), 0 (already there), -1 (over a bound: not kept).
_RECORD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local used = tonumber(redis.call('HGET', KEYS[1], ARGV[6]) or '0')
local records = redis.call('HLEN', KEYS[1])
if used > 0 then records = records - 1 end
if records >= tonumber(ARGV[4]) or used + #ARGV[2] > tonumber(ARGV[5]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[6], used + #ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


def encode_record(completion: Completion) -> bytes:
    """A journal record: ``completion`` as JSON (its ``cached`` flag is not kept)."""
    return json.dumps(completion.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()


def decode_record(raw: object) -> Completion | None:
    """The answer in a record, or None if it is not one (wrong type, too long, malformed)."""
    if not isinstance(raw, bytes) or len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        data = json.loads(raw)
        return Completion.from_dict(data) if isinstance(data, dict) else None
    except ValueError:  # UnicodeDecodeError and json's errors among them
        return None


@dataclass(frozen=True)
class JournalStore:
    """Where journals live: the fleet's Redis (a worker's ``redis_url``), each call
    within ``timeout_s``."""

    url: str
    timeout_s: float

    async def run(self, *command: Any, max_bulk: int | None = None) -> Any:
        """One command on a connection of its own; ``RedisConnectionLost`` or
        ``ReplyError`` on failure."""
        # The Redis client loads with a worker's first journal, not with asyncgraph.models.
        from asyncgraph.resp import Pool, ReplyError, parse_redis_url

        pool = Pool(parse_redis_url(self.url), timeout_s=self.timeout_s, max_idle=0)
        try:
            (reply,) = await pool.pipeline([command], max_bulk=max_bulk, retry=True)
        finally:
            with anyio.CancelScope(shield=True):
                await pool.aclose()
        if isinstance(reply, ReplyError):
            raise reply
        return reply


class CallJournal:
    """The journal of one task: ``name(digest)`` names a call as it is issued,
    ``await replay(name)`` gives its recorded answer (only on a rerun), ``await
    record(name, completion)`` keeps one. Neither raises for Redis: see NOTE [Call
    journal]."""

    def __init__(self, store: JournalStore, key: str, *, ttl_s: float, rerun: bool) -> None:
        self.store = store
        self.key = key
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.rerun = rerun  # a delivery before this one may have recorded calls
        self._lock = threading.Lock()  # a task's calls may come from threads too
        self._seen: dict[str, int] = {}

    def name(self, digest: str) -> str:
        """The name of the next call of request ``digest``: ``<digest>:<occurrence>``."""
        with self._lock:
            n = self._seen.get(digest, 0)
            self._seen[digest] = n + 1
        return f"{digest}:{n}"

    async def replay(self, name: str) -> Completion | None:
        """The answer an earlier delivery recorded for call ``name``; None on a first
        delivery, a miss, an unreadable record or a Redis error."""
        if not self.rerun:
            return None
        try:
            raw = await self.store.run("HGET", self.key, name, max_bulk=MAX_RECORD_BYTES)
        except Exception as exc:  # Redis down, refusing, or a cluster moving: a miss
            logger.warning("call journal at %s: read failed (%s)", self._where(), exc)
            return None
        completion = decode_record(raw)
        if raw is not None and completion is None:
            logger.warning("call journal at %s: unreadable record %s", self._where(), name)
        return completion

    async def record(self, name: str, completion: Completion) -> None:
        """Keep ``completion`` as call ``name``'s answer (unless over a bound, or
        Redis fails: logged)."""
        data = encode_record(completion)
        if len(data) > MAX_RECORD_BYTES:
            logger.info("call journal: an answer of %d bytes is not kept", len(data))
            return
        try:
            kept = await self.store.run(
                "EVAL",
                _RECORD,
                1,
                self.key,
                name,
                data,
                self.ttl_ms,
                MAX_RECORDS,
                MAX_TASK_BYTES,
                _BYTES_FIELD,
            )
        except Exception as exc:  # as in replay: the answer is returned all the same
            logger.warning("call journal at %s: write failed (%s)", self._where(), exc)
            return
        if kept == -1:
            logger.info("call journal %s is full: this call is not kept", self.key)

    def _where(self) -> str:
        return f"{redact_url(self.store.url)} ({self.key})"


_JOURNAL: contextvars.ContextVar[CallJournal | None] = contextvars.ContextVar(
    "asyncgraph_call_journal", default=None
)


def current_journal() -> CallJournal | None:
    """The journal of the remote task this code runs in, if any."""
    return _JOURNAL.get()


@contextmanager
def journaling(journal: CallJournal | None) -> Iterator[None]:
    """Make ``journal`` the current one inside the block (None: no journal)."""
    token = _JOURNAL.set(journal)
    try:
        yield
    finally:
        _JOURNAL.reset(token)
