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
- Records are JSON (``Completion.to_dict``), sealed with the fleet's secret (the
  worker's ``Signer``: an HMAC bound to the journal's key and the call's name; NOTE
  [Sealed records] in ``asyncgraph.distributed.wire._signing``), verified, validated
  (token counts from 0 to ``MAX_TOKENS``) and size-capped on read. A record that fails
  is ignored and reported (a WARNING naming the key, and the worker's
  ``asyncgraph_worker_ignored_records_total{record="journal"}``): the call is made
  again, and its answer replaces the record. Paying twice is better than trusting a
  forgery. Nothing is unpickled.
- The journal saves money, it does not make results correct: a Redis error while
  reading or writing it during a task is logged (logger ``asyncgraph.models``) and the
  call goes on as if there were no journal. A journal the worker's Redis user cannot
  write at all is an error when the worker starts (``check_journal``), not a warning
  per call.

Each journal operation takes a connection of its own, closed before it returns (a
model call takes 100 ms or more; a connection to Redis well under one), so nothing is
left open when a task or a worker ends.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from asyncgraph._exceptions import ConfigError
from asyncgraph._redact import redact_url
from asyncgraph.models._types import Completion

__all__ = [
    "MAX_RECORDS",
    "MAX_RECORD_BYTES",
    "MAX_TASK_BYTES",
    "CallJournal",
    "JournalStore",
    "RecordSeal",
    "check_journal",
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
_SEAL_BYTES = 1024  # room for a record's seal when it is read (an HMAC and a marker)

# Keep the first answer of a call (a stalled worker and its replacement may both write),
# within the task's bounds, and expire the whole journal with the task's last chance to
# be rerun; one round trip, one key (so one slot on a Redis Cluster).
# ARGV[7] == '1' replaces a record that failed verification (its bytes stay counted).
# Returns 1 (kept), 0 (already there), -1 (over a bound: not kept).
_RECORD = """
if ARGV[7] ~= '1' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local used = tonumber(redis.call('HGET', KEYS[1], ARGV[6]) or '0') or -1
local records = redis.call('HLEN', KEYS[1])
if used ~= 0 then records = records - 1 end
if used < 0 or records >= tonumber(ARGV[4]) or used + #ARGV[2] > tonumber(ARGV[5]) then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[6], used + #ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


def encode_record(completion: Completion) -> bytes:
    """A journal record: ``completion`` as JSON (its ``cached`` flag is not kept)."""
    return json.dumps(completion.to_dict(), ensure_ascii=False, separators=(",", ":")).encode()


# What a worker's Redis user needs for the journal: the script, what it runs, and HGET.
_SCRIPT_CALLS = re.compile(r"redis\.call\('(\w+)'")
_PERMISSIONS = " ".join(
    f"+{c}" for c in sorted({"eval", "hget", *map(str.lower, _SCRIPT_CALLS.findall(_RECORD))})
)


def _refused_command(error: str) -> str | None:
    """The command of the journal's script that an ACL refused, from Redis's error: named
    in it (Redis 7, Valkey), or found on the script's line it names (Redis 6.2 says only
    ``@user_script:2: ... can't run this command``)."""
    named = re.search(r"run the '(\w+)' command", error)
    if named:
        return named.group(1).lower()
    line = re.search(r"@user_script:\s*(\d+)", error)
    lines = _RECORD.split("\n")
    if line and 0 < int(line.group(1)) <= len(lines):
        calls: list[str] = _SCRIPT_CALLS.findall(lines[int(line.group(1)) - 1])
        if len(calls) == 1:
            return calls[0].lower()
    return None


def decode_record(raw: object) -> Completion | None:
    """The answer in a record's payload (unsealed), or None if it is not one (wrong type,
    too long, malformed, a token count out of bounds)."""
    if not isinstance(raw, bytes) or len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        data = json.loads(raw)
        return Completion.from_dict(data) if isinstance(data, dict) else None
    except ValueError:  # UnicodeDecodeError and json's errors among them
        return None


class RecordSeal(Protocol):
    """What seals a record for Redis and verifies it when read back: the fleet's
    ``Signer`` (``asyncgraph.distributed``), handed to this layer by the worker; see NOTE
    [Sealed records] in ``asyncgraph.distributed.wire._signing``."""

    def seal(self, key: str, field: str, payload: bytes) -> bytes: ...

    def unseal(self, key: str, field: str, stored: object) -> bytes | None: ...


@dataclass(frozen=True)
class JournalStore:
    """Where journals live: the fleet's Redis (a worker's ``redis_url``), each call
    within ``timeout_s``; ``seal`` signs and verifies every record (the worker's
    ``Signer``), ``on_ignored("journal")`` counts a record that failed."""

    url: str
    timeout_s: float
    seal: RecordSeal
    on_ignored: Callable[[str], None] | None = None

    async def run(self, *command: Any, max_bulk: int | None = None) -> Any:
        """One command on a connection of its own; ``RedisConnectionLost`` or
        ``ReplyError`` on failure."""
        from asyncgraph.resp import Pool, ReplyError, parse_redis_url  # loaded on first use

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
        self._ignored: set[str] = set()  # calls whose record failed: replaced when made

    def name(self, digest: str) -> str:
        """The name of the next call of request ``digest``: ``<digest>:<occurrence>``."""
        with self._lock:
            n = self._seen.get(digest, 0)
            self._seen[digest] = n + 1
        return f"{digest}:{n}"

    async def replay(self, name: str) -> Completion | None:
        """The answer an earlier delivery recorded for call ``name``; None on a first
        delivery, a miss, a record that fails verification or validation (reported) or a
        Redis error."""
        if not self.rerun:
            return None
        try:
            stored = await self._read(name)
        except Exception as exc:  # Redis down, refusing, or a cluster moving: a miss
            logger.warning("call journal at %s: read failed (%s)", self._where(), exc)
            return None
        if stored is None:
            return None
        payload = self.store.seal.unseal(self.key, name, stored)
        completion = None if payload is None else decode_record(payload)
        if completion is None:
            with self._lock:
                self._ignored.add(name)
            if self.store.on_ignored is not None:
                self.store.on_ignored("journal")
            logger.warning(
                "call journal at %s: the record of call %s %s: ignored, the call is made again",
                self._where(),
                name,
                "failed verification (unsealed, forged, moved or signed with another secret)"
                if payload is None
                else "is not a valid answer",
            )
        return completion

    async def record(self, name: str, completion: Completion) -> None:
        """Keep ``completion`` as call ``name``'s answer (unless over a bound, or
        Redis fails: logged)."""
        payload = encode_record(completion)
        if len(payload) > MAX_RECORD_BYTES:
            logger.info("call journal: an answer of %d bytes is not kept", len(payload))
            return
        with self._lock:
            replace = name in self._ignored
        try:
            kept = await self._write(name, payload, replace=replace)
        except Exception as exc:  # as in replay: the answer is returned all the same
            logger.warning("call journal at %s: write failed (%s)", self._where(), exc)
            return
        if kept == -1:
            logger.info("call journal %s is full: this call is not kept", self.key)

    async def _read(self, name: str) -> object:
        """The stored (sealed) record of call ``name``, None if absent; raises for Redis."""
        return await self.store.run("HGET", self.key, name, max_bulk=MAX_RECORD_BYTES + _SEAL_BYTES)

    async def _write(self, name: str, payload: bytes, *, replace: bool = False) -> Any:
        """Seal and keep ``payload`` as call ``name``'s record (the script's answer: 1
        kept, 0 already there, -1 over a bound); raises for Redis."""
        return await self.store.run(
            "EVAL",
            _RECORD,
            1,
            self.key,
            name,
            self.store.seal.seal(self.key, name, payload),
            self.ttl_ms,
            MAX_RECORDS,
            MAX_TASK_BYTES,
            _BYTES_FIELD,
            1 if replace else 0,
        )

    def _where(self) -> str:
        return f"{redact_url(self.store.url)} ({self.key})"


async def check_journal(store: JournalStore, key: str) -> None:
    """Write one record at ``key`` and read it back, as a task's journal does: raises
    ``ConfigError`` saying what Redis refused (a NOPERM names the missing permission) and
    what to grant, when the journal cannot work with this Redis user. A worker runs it
    once at start; the probe record is gone when it returns (expired by a last write).

    A Redis that refuses writes for want of memory (OOM) is not an error here: that
    passes, and the calls go on without a journal meanwhile (each logs it).
    """
    from asyncgraph.resp import ReplyError

    journal = CallJournal(store, key, ttl_s=store.timeout_s * 2, rerun=True)
    name, payload = "probe:0", encode_record(Completion("probe", model="probe"))
    try:
        await journal._write(name, payload)  # every command of the script, as a task's
        stored = await journal._read(name)
        journal.ttl_ms = 1  # the same write once more, expiring the probe at once
        await journal._write(name, payload, replace=True)
    except ReplyError as exc:
        if exc.code == "OOM":
            logger.warning(
                "call journal at %s: Redis refused the probe (%s)", journal._where(), exc
            )
            return
        refused = _refused_command(str(exc))
        raise ConfigError(
            "redis_url",
            f"the call journal cannot be written and read at {journal._where()}: Redis "
            f"answered {exc}"
            + (f" (the command refused: {refused!r})" if refused else "")
            + f". A worker's Redis user needs `{_PERMISSIONS}` on the keys "
            "`asyncgraph:{QUEUE}:calls:*` (the worker role in docs/how-to/fleet.md, "
            "'A Redis user with only what it needs')",
        ) from exc
    if store.seal.unseal(key, name, stored) != payload:
        raise ConfigError(
            "redis_url",
            f"the call journal at {journal._where()} did not read back the record this "
            f"worker wrote (got {stored!r:.80})",
        )


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
