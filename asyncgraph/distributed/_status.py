"""``asyncgraph status [--redis URL] [--queue Q] [--watch] [--json]``: the fleet at a glance.

The fleet's Redis comes from ``--redis`` or ``$ASYNCGRAPH_REDIS_URL``; without either the
command says so in one line and exits 2.

Reads only what the protocol already keeps in Redis (no worker is asked anything):
the heartbeat and info hashes (workers: host, pid, concurrency, in flight, last
heartbeat, version, draining), the task stream and its consumer group (depth, pending,
the oldest pending entry's idle time), the tasks per second the workers settle (what
each publishes with its heartbeat, on Redis 6.2 as on 7), and the dead-letter stream (count and the
latest reasons). Every value is parsed as data
(integers, JSON); nothing read is ever imported or unpickled. Anyone who can write to
Redis chooses these values: one that does not parse (a heartbeat that is not a number,
an info that is not a JSON object, a field of the wrong type, a key of the wrong type) is
named in ``malformed`` and shown as unknown, and the rest of the reading is shown as ever.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from asyncgraph import RemoteConnectionError
from asyncgraph._exceptions import RedisConnectionLost, ReplyError
from asyncgraph._redact import redact
from asyncgraph.distributed._liveness import live_consumers, redis_time_ms
from asyncgraph.distributed.wire import _keys as keys

if TYPE_CHECKING:
    from asyncgraph.resp import Pool

__all__ = ["add_arguments", "fleet_status", "format_status", "run"]

_LATEST_DEAD = 5
REDIS_URL_ENV = "ASYNCGRAPH_REDIS_URL"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# C0, DEL and C1 (U+0080..U+009F: some terminals read U+009B as CSI) controls.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {ord("\n"): "\\n"}


# Unicode's bidi controls (the embeddings, overrides and isolates, U+202A..U+202E and
# U+2066..U+2069, and the marks U+061C, U+200E, U+200F): U+202E shows the rest of a line
# reversed on a terminal that renders bidi text. And the line and paragraph separators.
_BIDI_CONTROLS = (0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F))
_BIDI = {c: f"\\u{c:04x}" for c in (*_BIDI_CONTROLS, *range(0x2066, 0x206A))}


def _escape_bidi(text: str) -> str:
    """``text`` with every Unicode bidi control shown as its ``\\uXXXX`` escape."""
    return text.translate(_BIDI)


def _shown(value: Any) -> str:
    """``value`` as text safe for a terminal: a stored escape sequence, carriage return
    or bidi override (anyone who can write to Redis chose it) is shown escaped, never
    sent raw."""
    return _escape_bidi(str(value).translate(_CONTROL))


def _raw_pairs(flat: Any) -> list[tuple[Any, Any]]:
    if not isinstance(flat, list):
        return []
    return list(zip(flat[::2], flat[1::2], strict=False))


def _pairs(flat: Any) -> dict[str, Any]:
    return {_text(k): v for k, v in _raw_pairs(flat)}


# -- one worker's entry, parsed as data (pure) -----------------------------------------

_MAX_INT = 2**63  # Redis's integers, and anything a worker writes, fit in 64 bits


def _heartbeat_ms(value: Any) -> int | None:
    """A heartbeat's expiry in ms of Redis's clock, or None when it is not one."""
    if not isinstance(value, (bytes, int)):
        return None
    try:
        number = int(value)
    except ValueError:  # not an integer, or more digits than int() reads
        return None
    return number if -_MAX_INT < number < _MAX_INT else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INT


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e15


# What each field of a worker's info must be (``_membership.info_json`` writes them), with
# its value when the worker did not write it (an older one).
_INFO_FIELDS: dict[str, tuple[str, Callable[[Any], bool], Any]] = {
    "host": ("a text", lambda v: isinstance(v, str), None),
    "pid": ("an integer", _is_count, None),
    "concurrency": ("an integer", _is_count, None),
    "in_flight": ("an integer", _is_count, None),
    "abandoned": ("an integer", _is_count, 0),
    "settled": ("an integer", _is_count, 0),
    "settled_per_s": ("a number", lambda v: _is_number(v) and v < 1e9, 0.0),
    "version": ("a text", lambda v: isinstance(v, str), None),
    "draining": ("true or false", lambda v: isinstance(v, bool), None),
    "started": ("a number", _is_number, None),
}
_JSON_KINDS = {list: "list", str: "text", int: "number", float: "number", bool: "boolean"}


def _info(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """A worker's info hash entry as its fields (each the expected type, else its default)
    and what was malformed in it."""
    info: Any = {}
    if raw is not None:
        try:
            info = json.loads(_text(raw))
        except (ValueError, RecursionError):
            return _info(None)[0], ["info is not JSON"]
    if not isinstance(info, dict):
        kind = "null" if info is None else _JSON_KINDS.get(type(info), type(info).__name__)
        return _info(None)[0], [f"info is a JSON {kind}, not an object"]
    fields, malformed = {}, []
    for field, (kind, valid, default) in _INFO_FIELDS.items():
        value = info.get(field, default)
        if value is not default and not valid(value):
            malformed.append(f"{field} is not {kind}")
            value = None
        fields[field] = value
    return fields, malformed


def _worker(
    name: bytes, beat: Any, raw_info: Any, now_ms: int, alive: set[bytes]
) -> dict[str, Any]:
    """One worker's entry of the reading, from its heartbeat and info as Redis holds them;
    ``malformed`` names what did not parse (shown as None), empty when all did."""
    expiry = _heartbeat_ms(beat)
    fields, malformed = _info(raw_info)
    if expiry is None:
        malformed.insert(0, "heartbeat is not a number of ms")
    return {
        "name": _text(name),
        "alive": expiry is not None and name in alive,
        "expires_in_s": None if expiry is None else round((expiry - now_ms) / 1000, 1),
        **fields,
        "malformed": malformed,
    }


def _wrong_type(key: str, reply: Any, malformed: list[str], display: str) -> bool:
    """Whether ``reply`` says ``key`` holds another type than the one read (noted in
    ``malformed``, once per key); any other error reply (``NOPERM``) is raised."""
    if not isinstance(reply, ReplyError):
        return False
    if not str(reply).startswith("WRONGTYPE"):
        raise RemoteConnectionError(f"Redis at {display} refused: {reply}")
    note = f"{key}: {reply}"
    if note not in malformed:
        malformed.append(note)
    return True


@dataclass(slots=True)
class _Reading:
    """What one reading found in Redis, each value as Redis returned it; a key of the wrong
    type reads as empty (``dead_len``, ``length``, ``group``: None) and is named in
    ``malformed``."""

    now: Any
    beats: Any
    infos: Any
    exists: Any
    dead_len: int | None
    latest: Any
    length: int | None
    group: dict[str, Any] | None
    oldest_ms: int | None
    malformed: list[str]


async def fleet_status(url: str, queue: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """One reading of the fleet serving ``queue`` at ``url`` (JSON data).

    Raises ``RemoteConnectionError`` when Redis does not answer within ``timeout_s``,
    ``ValueError`` for a bad URL or queue name.
    """
    keys.check_queue_name(queue)
    from asyncgraph.resp import Pool, parse_redis_url  # the client loads to read, not for --help

    address = parse_redis_url(url)
    pool = Pool(address, timeout_s=timeout_s)
    try:
        with anyio.fail_after(timeout_s):
            reading = await _read(pool, queue, address.display)
    except (RedisConnectionLost, TimeoutError) as exc:
        raise RemoteConnectionError(
            f"{exc or f'no answer from Redis at {address.display}'} (waited up to "
            f"{timeout_s:g} s); check --redis and that Redis is up"
        ) from None
    except ReplyError as exc:  # e.g. WRONGPASS or NOAUTH while connecting
        raise RemoteConnectionError(
            f"Redis at {address.display} refused the connection: {exc}; check the "
            f"user name and password in --redis (or $ASYNCGRAPH_REDIS_URL)"
        ) from None
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
    return _status(reading, address.display, queue)


async def _read(pool: Pool, queue: str, shown: str) -> _Reading:
    """Read the fleet's keys (two round trips: the task stream's details only when it
    exists); a key of the wrong type reads as empty, any other refusal is raised."""
    tasks, dead = keys.task_stream(queue), keys.dead_stream(queue)
    beats_key, infos_key = keys.workers_hash(queue), keys.workers_info_hash(queue)
    malformed: list[str] = []
    now, beats, infos, exists, dead_len, latest = await pool.pipeline(
        [
            ["TIME"],
            ["HGETALL", beats_key],
            ["HGETALL", infos_key],
            ["EXISTS", tasks],
            ["XLEN", dead],
            ["XREVRANGE", dead, "+", "-", "COUNT", _LATEST_DEAD],
        ]
    )
    for reply in (now, exists):
        if isinstance(reply, ReplyError):
            raise RemoteConnectionError(f"Redis at {shown} refused: {reply}")
    beats = [] if _wrong_type(beats_key, beats, malformed, shown) else beats
    infos = [] if _wrong_type(infos_key, infos, malformed, shown) else infos
    dead_len = None if _wrong_type(dead, dead_len, malformed, shown) else int(dead_len)
    latest = [] if _wrong_type(dead, latest, malformed, shown) else latest
    length, group, oldest_ms = (
        await _read_task_stream(pool, tasks, malformed, shown) if exists == 1 else (0, {}, None)
    )
    return _Reading(
        now, beats, infos, exists, dead_len, latest, length, group, oldest_ms, malformed
    )


async def _read_task_stream(
    pool: Pool, tasks: str, malformed: list[str], shown: str
) -> tuple[int | None, dict[str, Any] | None, int | None]:
    """The task stream's length, its consumer group's fields (``XINFO GROUPS``) and the
    idle time in ms of its oldest pending entry; None for each when the key is not a stream."""
    length, groups, oldest = await pool.pipeline(
        [
            ["XLEN", tasks],
            ["XINFO", "GROUPS", tasks],
            ["XPENDING", tasks, keys.GROUP, "-", "+", 1],
        ]
    )
    group: dict[str, Any] | None = {}
    if _wrong_type(tasks, length, malformed, shown):
        length, group, groups, oldest = None, None, [], []
    for entry in groups if isinstance(groups, list) else []:
        fields = _pairs(entry)
        if _text(fields.get("name", b"")) == keys.GROUP:
            group = fields
    oldest_ms = int(oldest[0][2]) if isinstance(oldest, list) and oldest else None
    return length, group, oldest_ms


def _status(reading: _Reading, shown: str, queue: str) -> dict[str, Any]:
    """The reading as ``fleet_status`` returns it (pure)."""
    now_ms = redis_time_ms(reading.now)
    alive = live_consumers(reading.now, reading.beats)
    info_by_name = dict(_raw_pairs(reading.infos))
    workers = [
        _worker(bytes(name), beat, info_by_name.get(name), now_ms, alive)
        for name, beat in _raw_pairs(reading.beats)
    ]
    length, group, oldest_ms = reading.length, reading.group, reading.oldest_ms
    return {
        "redis": shown,
        "queue": queue,
        "known": reading.exists == 1 or bool(workers),
        "time_ms": now_ms,
        "workers": sorted(workers, key=lambda w: w["name"]),
        "alive": sum(w["alive"] for w in workers),
        # Each live worker publishes what it settled per second since its previous status
        # (every few seconds, with its heartbeat): one reading has the rate, on Redis 6.2
        # as on 7 (XINFO GROUPS' entries-read is 7.0's).
        "tasks_per_s": round(sum(w["settled_per_s"] or 0 for w in workers if w["alive"]), 1),
        "depth": None if length is None else int(length),
        "pending": None if group is None else int(group.get("pending") or 0),
        "oldest_pending_s": None if oldest_ms is None else round(oldest_ms / 1000, 1),
        "dead_letters": reading.dead_len,
        "latest_dead_letters": _dead_letters(reading.latest),
        "malformed": reading.malformed,
    }


def _dead_letters(latest: Any) -> list[dict[str, str]]:
    """The latest dead letters (``XREVRANGE`` entries), each as id, reason, error, worker."""
    dead_letters = []
    for entry_id, fields in latest if isinstance(latest, list) else []:
        data = _pairs(fields)
        dead_letters.append(
            {
                "id": _text(entry_id),
                "reason": _text(data.get("reason", b"")),
                # Workers redact what they write; an older or foreign entry may not be.
                "error": redact(_text(data.get("error", b"")))[:200],
                "worker": _text(data.get("worker", b"")),
            }
        )
    return dead_letters


def format_status(status: dict[str, Any], rate: float | None = None) -> str:
    """The reading as a few lines for a terminal (every value read from Redis escaped)."""
    lines = [_shown(line) for line in _status_lines(status, rate)]
    return "\n".join(lines)


def _unknown(value: Any) -> Any:
    return "?" if value is None else value


def _status_lines(status: dict[str, Any], rate: float | None) -> list[str]:
    if not status["known"]:
        return [
            f"queue {status['queue']!r} at {status['redis']}: unknown (no task stream and no "
            f"worker has ever served it; check --queue)"
        ]
    lines = [
        f"queue {status['queue']!r} at {status['redis']}: {status['alive']} worker(s) alive, "
        f"depth {_unknown(status['depth'])}, pending {_unknown(status['pending'])}"
        + (
            f" (oldest idle {status['oldest_pending_s']} s)"
            if status["oldest_pending_s"] is not None
            else ""
        )
        + (f", {rate:.1f} tasks/s" if rate is not None else ""),
    ]
    for w in status["workers"]:
        lines.append(_worker_line(w))
    lines.append(f"dead letters: {_unknown(status['dead_letters'])}")
    for d in status["latest_dead_letters"]:
        lines.append(f"  {d['id']} {d['reason']}: {d['error'][:100]}")
    lines += [f"malformed: {note}" for note in status.get("malformed", [])]
    return lines


def _worker_line(w: dict[str, Any]) -> str:
    malformed = w.get("malformed") or []
    if w["expires_in_s"] is None:  # no heartbeat to say whether it is alive
        state = f"malformed ({'; '.join(malformed)})"
    else:
        state = "draining" if w.get("draining") else ("alive" if w["alive"] else "silent")
        state += f", malformed ({'; '.join(malformed)})" if malformed else ""
    beat = (
        "heartbeat unreadable"
        if w["expires_in_s"] is None
        else f"heartbeat expires in {w['expires_in_s']} s"
    )
    return (
        f"  {w['name']}: {state}, host {w.get('host')}, pid {w.get('pid')}, "
        f"{w.get('in_flight')}/{w.get('concurrency')} in flight, "
        + (
            f"{w['abandoned']} abandoned synchronous call(s) holding slots, "
            if w.get("abandoned")
            else ""
        )
        + f"{beat}, version {w.get('version')}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis",
        metavar="URL",
        # Not required=: $ASYNCGRAPH_REDIS_URL may give it (run() says when neither does),
        # and the usage line must not depend on the environment it is printed in.
        default=os.environ.get(REDIS_URL_ENV),
        help=f"the fleet's Redis (default ${REDIS_URL_ENV}; one of them is needed; prefer "
        f"the variable when the URL holds a password: argv is visible to other users)",
    )
    parser.add_argument("--queue", default="grads", help="the workers' queue (default: grads)")
    parser.add_argument(
        "--watch", action="store_true", help="read again every --interval seconds (Ctrl-C stops)"
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds between readings"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one object per reading)")


def run(args: argparse.Namespace) -> int:
    if not args.redis:
        print(
            f"error: no Redis to read: pass --redis URL or set ${REDIS_URL_ENV} "
            f"(e.g. redis://127.0.0.1:6379/0)",
            file=sys.stderr,
        )
        return 2

    async def main() -> int:
        while True:
            status = await fleet_status(args.redis, args.queue)
            rate = status["tasks_per_s"]
            if args.json:
                print(json.dumps(status), flush=True)
            else:
                print(format_status(status, rate), flush=True)
            if not args.watch:
                return 0 if status["known"] else 1
            await anyio.sleep(args.interval)

    try:
        return anyio.run(main)
    except KeyboardInterrupt:
        return 130
    except (RemoteConnectionError, ValueError) as exc:
        print(f"error: {_shown(exc)}", file=sys.stderr)
        return 1
