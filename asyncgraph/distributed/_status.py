"""``asyncgraph status --redis URL [--queue Q] [--watch] [--json]``: the fleet at a glance.

Reads only what the protocol already keeps in Redis (no worker is asked anything):
the heartbeat and info hashes (workers: host, pid, concurrency, in flight, last
heartbeat, version, draining), the task stream and its consumer group (depth, pending,
the oldest pending entry's idle time), the tasks per second the workers settle (what
each publishes with its heartbeat, on Redis 6.2 as on 7), and the dead-letter stream (count and the
latest reasons). Every value is parsed as data
(integers, JSON); nothing read is ever imported or unpickled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import anyio

from asyncgraph import RemoteConnectionError
from asyncgraph._redact import redact
from asyncgraph.distributed._liveness import live_consumers, redis_time_ms
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.resp import Pool, RedisConnectionLost, ReplyError, parse_redis_url

__all__ = ["add_arguments", "fleet_status", "format_status", "run"]

_LATEST_DEAD = 5
REDIS_URL_ENV = "ASYNCGRAPH_REDIS_URL"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


# C0, DEL and C1 (U+0080..U+009F: some terminals read U+009B as CSI) controls.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {ord("\n"): "\\n"}


def _shown(value: Any) -> str:
    """``value`` as text safe for a terminal: a stored escape sequence or carriage
    return (anyone who can write to Redis chose it) is shown escaped, never sent raw."""
    return str(value).translate(_CONTROL)


def _rate(value: Any) -> float:
    """A worker's published rate, if it is one (anyone who can write to Redis wrote it)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
    return float(value) if ok else 0.0


def _pairs(flat: Any) -> dict[str, Any]:
    if not isinstance(flat, list):
        return {}
    return {_text(k): v for k, v in zip(flat[::2], flat[1::2], strict=False)}


async def fleet_status(url: str, queue: str, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """One reading of the fleet serving ``queue`` at ``url`` (JSON data).

    Raises ``RemoteConnectionError`` when Redis does not answer within ``timeout_s``,
    ``ValueError`` for a bad URL or queue name.
    """
    keys.check_queue_name(queue)
    address = parse_redis_url(url)
    pool = Pool(address, timeout_s=timeout_s)
    tasks, dead = keys.task_stream(queue), keys.dead_stream(queue)
    try:
        with anyio.fail_after(timeout_s):
            now, beats, infos, exists, dead_len, latest = await pool.pipeline(
                [
                    ["TIME"],
                    ["HGETALL", keys.workers_hash(queue)],
                    ["HGETALL", keys.workers_info_hash(queue)],
                    ["EXISTS", tasks],
                    ["XLEN", dead],
                    ["XREVRANGE", dead, "+", "-", "COUNT", _LATEST_DEAD],
                ]
            )
            group: dict[str, Any] = {}
            oldest_ms: int | None = None
            length = 0
            if exists == 1:
                length, groups, oldest = await pool.pipeline(
                    [
                        ["XLEN", tasks],
                        ["XINFO", "GROUPS", tasks],
                        ["XPENDING", tasks, keys.GROUP, "-", "+", 1],
                    ]
                )
                for entry in groups if isinstance(groups, list) else []:
                    fields = _pairs(entry)
                    if _text(fields.get("name", b"")) == keys.GROUP:
                        group = fields
                if isinstance(oldest, list) and oldest:
                    oldest_ms = int(oldest[0][2])
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
    for reply in (now, beats, infos, exists, dead_len, latest):
        if isinstance(reply, ReplyError):
            raise RemoteConnectionError(f"Redis at {address.display} refused: {reply}")
    now_ms = redis_time_ms(now)
    alive = live_consumers(now, beats)
    workers = []
    info_by_name = _pairs(infos)
    for name, expiry in _pairs(beats).items():
        try:
            info = json.loads(_text(info_by_name.get(name, b"{}")))
        except ValueError:
            info = {}
        workers.append(
            {
                "name": name,
                "alive": name.encode() in alive,
                "expires_in_s": round((int(expiry) - now_ms) / 1000, 1),
                **{k: info.get(k) for k in ("host", "pid", "concurrency", "in_flight")},
                "abandoned": info.get("abandoned", 0),
                "settled": info.get("settled") if isinstance(info.get("settled"), int) else 0,
                "settled_per_s": _rate(info.get("settled_per_s")),
                **{k: info.get(k) for k in ("version", "draining", "started")},
            }
        )
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
    return {
        "redis": address.display,
        "queue": queue,
        "known": exists == 1 or bool(workers),
        "time_ms": now_ms,
        "workers": sorted(workers, key=lambda w: w["name"]),
        "alive": sum(w["alive"] for w in workers),
        # Each live worker publishes what it settled per second since its previous status
        # (every few seconds, with its heartbeat): one reading has the rate, on Redis 6.2
        # as on 7 (XINFO GROUPS' entries-read is 7.0's).
        "tasks_per_s": round(sum(w["settled_per_s"] for w in workers if w["alive"]), 1),
        "depth": int(length) if exists == 1 else 0,
        "pending": int(group.get("pending") or 0) if group else 0,
        "oldest_pending_s": None if oldest_ms is None else round(oldest_ms / 1000, 1),
        "dead_letters": int(dead_len),
        "latest_dead_letters": dead_letters,
    }


def format_status(status: dict[str, Any], rate: float | None = None) -> str:
    """The reading as a few lines for a terminal (every value read from Redis escaped)."""
    lines = [_shown(line) for line in _status_lines(status, rate)]
    return "\n".join(lines)


def _status_lines(status: dict[str, Any], rate: float | None) -> list[str]:
    if not status["known"]:
        return [
            f"queue {status['queue']!r} at {status['redis']}: unknown (no task stream and no "
            f"worker has ever served it; check --queue)"
        ]
    lines = [
        f"queue {status['queue']!r} at {status['redis']}: {status['alive']} worker(s) alive, "
        f"depth {status['depth']}, pending {status['pending']}"
        + (
            f" (oldest idle {status['oldest_pending_s']} s)"
            if status["oldest_pending_s"] is not None
            else ""
        )
        + (f", {rate:.1f} tasks/s" if rate is not None else ""),
    ]
    for w in status["workers"]:
        state = "draining" if w.get("draining") else ("alive" if w["alive"] else "silent")
        lines.append(
            f"  {w['name']}: {state}, host {w.get('host')}, pid {w.get('pid')}, "
            f"{w.get('in_flight')}/{w.get('concurrency')} in flight, "
            + (
                f"{w['abandoned']} abandoned synchronous call(s) holding slots, "
                if w.get("abandoned")
                else ""
            )
            + f"heartbeat expires in {w['expires_in_s']} s, version {w.get('version')}"
        )
    lines.append(f"dead letters: {status['dead_letters']}")
    for d in status["latest_dead_letters"]:
        lines.append(f"  {d['id']} {d['reason']}: {d['error'][:100]}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get(REDIS_URL_ENV),
        required=REDIS_URL_ENV not in os.environ,
        help=f"the fleet's Redis (${REDIS_URL_ENV}; prefer the variable when the URL holds a "
        f"password: argv is visible to other users)",
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
        print(f"error: {exc}", file=sys.stderr)
        return 1
