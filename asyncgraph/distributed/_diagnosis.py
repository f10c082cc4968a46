"""Why a remote node's reply did not come: the timeout diagnosis, as a pure function.

``commands(queue, entry_id)`` lists what to ask Redis (one round trip, taken before
the task is cancelled, so the diagnosis sees where it was); ``explain(replies, ...)``
turns the answers into one sentence: no worker alive, or where the task is (waiting,
held by a live worker, held by a *silent* one: stopped or dead, reclaimed once its
lease runs out and a worker is alive), plus what the recent dead letters of this
client's tasks say (a wrong or missing secret is named).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncgraph.distributed._liveness import live_consumers
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._signing import SECRET_ENV
from asyncgraph.resp import ReplyError

__all__ = ["DEAD_LOOKBACK", "commands", "explain"]

DEAD_LOOKBACK = 200  # dead letters read by a diagnosis


def commands(queue: str, entry_id: bytes | None) -> list[list[Any]]:
    """The round trip a diagnosis needs (``entry_id``: the task's, once it was sent)."""
    stream = keys.task_stream(queue)
    asked: list[list[Any]] = [
        ["TIME"],
        ["HGETALL", keys.workers_hash(queue)],
        ["XLEN", stream],
        ["XREVRANGE", keys.dead_stream(queue), "+", "-", "COUNT", DEAD_LOOKBACK],
        ["XPENDING", stream, keys.GROUP],
    ]
    if entry_id is not None:
        asked += [
            ["XPENDING", stream, keys.GROUP, entry_id, entry_id, 1],
            ["XRANGE", stream, entry_id, entry_id],
        ]
    return asked


def explain(
    replies: Sequence[Any],
    *,
    queue: str,
    task_id: str,
    client_id: str,
    signed: bool,
    rejected_replies: int = 0,
) -> str:
    """The diagnosis sentence from the replies to ``commands`` (raises on a malformed one)."""
    now, beats, length, dead, summary = replies[:5]
    alive = live_consumers(now, beats)
    holders = _holders(summary)
    silent = {name: count for name, count in holders.items() if name not in alive}
    held_silently = sum(silent.values())
    waiting = max(0, int(length) - sum(holders.values()))
    parts: list[str] = []
    if not alive:
        parts.append(
            f"no worker of queue {queue!r} is alive: start one with `asyncgraph worker "
            f"--redis URL --queue {queue} --import MODULE` ({waiting} task(s) waiting"
            + (f", {_silent(silent)}" if silent else "")
            + ")"
        )
    else:
        where = _where(replies[5:], task_id, alive)
        parts.append(
            f"{where}{len(alive)} worker(s) alive, {waiting} task(s) waiting"
            + (f", {_silent(silent)}" if held_silently else "")
            + "; the workers are busy or the function is slower than the timeout"
        )
    parts += dead_letter_hints(dead, client_id, signed)
    if rejected_replies:
        parts.append(f"{rejected_replies} repl(ies) to this client were rejected (see the log)")
    return "; ".join(parts)


def _holders(summary: Any) -> dict[bytes, int]:
    """Pending entries per consumer, from ``XPENDING stream group``."""
    if not isinstance(summary, list) or len(summary) < 4 or not isinstance(summary[3], list):
        return {}
    return {bytes(name): int(count) for name, count in summary[3]}


def _silent(silent: dict[bytes, int]) -> str:
    names = ", ".join(n.decode(errors="replace") for n in sorted(silent)[:3])
    more = f" and {len(silent) - 3} more" if len(silent) > 3 else ""
    return (
        f"{sum(silent.values())} held by silent worker(s) {names}{more} (no heartbeat: stopped, "
        f"stuck or dead; their tasks are reclaimed when their lease runs out and a worker is "
        f"alive)"
    )


def _where(entry_replies: Sequence[Any], task_id: str, alive: set[bytes]) -> str:
    if len(entry_replies) < 2 or any(isinstance(r, ReplyError) for r in entry_replies):
        return ""
    held, queued = entry_replies[0], entry_replies[1]
    if held:
        _, consumer, idle_ms, deliveries = held[0]
        name = bytes(consumer)
        state = "" if name in alive else " (silent: no heartbeat; stopped, stuck or dead)"
        return (
            f"task {task_id} is being processed by worker {name.decode(errors='replace')}"
            f"{state} (delivered {int(deliveries)} time(s), lease renewed {int(idle_ms)} ms "
            f"ago): "
        )
    if queued:
        return f"task {task_id} is still waiting in the stream: "
    return (
        f"task {task_id} is no longer in the stream (answered, dead-lettered or deleted) "
        f"but its reply did not arrive: "
    )


def dead_letter_hints(dead: Any, client_id: str, signed: bool) -> list[str]:
    """What the recent dead letters of this client's tasks say (forged: the secret)."""
    reasons: dict[str, list[str]] = {}
    for _entry_id, fields in dead if isinstance(dead, list) else ():
        data = dict(zip(fields[::2], fields[1::2], strict=False))
        if data.get(keys.F_CLIENT) != client_id.encode():
            continue
        reason = data.get(keys.F_REASON)
        error = data.get(keys.F_ERROR)
        if isinstance(reason, bytes):
            reasons.setdefault(reason.decode(errors="replace"), []).append(
                error.decode(errors="replace") if isinstance(error, bytes) else ""
            )
    hints = []
    forged = reasons.pop(keys.REASON_FORGED, [])
    if forged:
        if signed:
            fix = (
                f"this client signs with another secret than the workers: give both the "
                f"same {SECRET_ENV}"
            )
        else:
            fix = (
                f"the workers require signed tasks and this client has no secret: pass "
                f"secret= to open_redis_executor or set {SECRET_ENV} to the workers' value"
            )
        hints.append(
            f"{len(forged)} task(s) of this client were dead-lettered as unsigned or "
            f"forged ({forged[0]}): {fix}"
        )
    for reason, errors in sorted(reasons.items()):
        hints.append(
            f"{len(errors)} task(s) of this client were dead-lettered ({reason}: {errors[0][:300]})"
        )
    return hints
