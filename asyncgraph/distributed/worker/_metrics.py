"""Worker counters, gauges and a summary, rendered in the Prometheus text exposition format.

No dependency: a worker from a plain ``pip install`` serves ``/metrics``.
Under ``--processes N`` each child writes a snapshot (its metrics and its
health) to a file in the supervisor's directory once a second; the supervisor
sums the metrics and aggregates the health.

Values print exactly: integers as integers (``1234567``, never ``1.23457e+06``),
floats with ``repr`` (shortest round-trip form).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncgraph._files import write_private_json

__all__ = [
    "Metrics",
    "format_value",
    "merge_snapshots",
    "process_metrics",
    "read_health",
    "render",
    "worker_metrics",
]

# Metric families: name -> (type, help). A summary's samples are <name>_sum and <name>_count.
HELP: dict[str, tuple[str, str]] = {
    "asyncgraph_worker_tasks_total": ("counter", "Tasks finished, by outcome."),
    "asyncgraph_worker_dead_letters_total": ("counter", "Messages dead-lettered, by reason."),
    "asyncgraph_worker_reclaimed_total": (
        "counter",
        "Tasks reclaimed from workers whose lease expired.",
    ),
    "asyncgraph_worker_redis_errors_total": ("counter", "Redis calls that failed."),
    "asyncgraph_worker_ignored_records_total": (
        "counter",
        "Records read back from Redis that failed verification or validation and were "
        "ignored (the work is done again), by record.",
    ),
    "asyncgraph_worker_task_seconds": ("summary", "Seconds spent running tasks."),
    "asyncgraph_worker_task_duration_seconds": (
        "histogram",
        "Seconds a task ran, by function and op (backward or forward).",
    ),
    "asyncgraph_worker_abandoned_calls": (
        "gauge",
        "Synchronous calls cancelled but still running in their threads (they take no slot).",
    ),
    "asyncgraph_worker_redis_refusals_total": (
        "counter",
        "Reply writes Redis refused (e.g. OOM at maxmemory), by error code.",
    ),
    "process_cpu_seconds_total": ("counter", "CPU seconds (user + system) of the process."),
    "process_resident_memory_bytes": ("gauge", "Resident memory of the process, in bytes."),
    "process_open_fds": ("gauge", "Open file descriptors of the process."),
    "process_start_time_seconds": ("gauge", "Start time of the process, Unix seconds."),
    "asyncgraph_worker_tasks_in_flight": ("gauge", "Tasks read and not yet acknowledged."),
    "asyncgraph_worker_processes": ("gauge", "Worker processes alive."),
    "asyncgraph_worker_restarts_total": (
        "counter",
        "Worker processes restarted by the supervisor.",
    ),
}

Key = tuple[str, tuple[tuple[str, str], ...]]
Number = int | float

# Every outcome and dead-letter reason a worker can count: their series exist from the
# start at 0 (a rate() over a series that appears only at its first event misses it).
OUTCOMES = (
    "ok",
    "error",
    "rejected",
    "cancelled",
    "expired",
    "dead_letter",
    "unknown_function",
    "fingerprint",
    "client_gone",
    "replayed",
    "memory_refused",
)
RECORDS = ("journal", "replay")  # records read back from Redis (NOTE [Sealed records])
DEAD_LETTER_REASONS = ("forged", "malformed", "oversize", "max_attempts", "error", "bad_cancel")
# Task durations: from a no-op (about a millisecond) to an LLM call of minutes.
DURATION_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _labels(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """A series' labels as part of its key (sorted; most series have none or one)."""
    if len(labels) < 2:
        return tuple(labels.items())
    return tuple(sorted(labels.items()))


def _family(name: str) -> str:
    """The family a sample belongs to (``x_sum`` / ``x_count`` / ``x_bucket`` of ``x``)."""
    for suffix in ("_sum", "_count", "_bucket"):
        base = name.removesuffix(suffix)
        if base != name and HELP.get(base, ("", ""))[0] in ("summary", "histogram"):
            return base
    return name


def _kind(name: str) -> str:
    return HELP.get(_family(name), ("gauge", ""))[0]


class _Histogram:
    """One histogram series: a count per bucket (not cumulative), the sum and the count.

    An observation is one bisection and three additions; the cumulative ``_bucket``
    samples are computed only when the metrics are rendered or snapshotted.
    """

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total: float = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def samples(
        self, name: str, labels: tuple[tuple[str, str], ...]
    ) -> Iterable[tuple[Key, Number]]:
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            le = (*labels, ("le", format_value(float(bound))))
            yield (f"{name}_bucket", tuple(sorted(le))), running
        yield (f"{name}_sum", labels), self.total
        yield (f"{name}_count", labels), self.count


class Metrics:
    """Counters, gauges and histograms with labels; ``render()`` gives the exposition text."""

    def __init__(self) -> None:
        self._values: dict[Key, Number] = {}
        self._histograms: dict[Key, _Histogram] = {}
        self._summaries: dict[str, tuple[str, str]] = {}  # name: its _sum and _count series

    @property
    def values(self) -> dict[Key, Number]:
        """Every sample (histograms as their ``_bucket``, ``_sum`` and ``_count`` series)."""
        out = dict(self._values)
        for (name, labels), histogram in self._histograms.items():
            out.update(histogram.samples(name, labels))
        return out

    def zero(self, name: str, **labels: str) -> None:
        """Make series ``name{labels}`` exist (at 0) before its first event."""
        self._values.setdefault((name, tuple(sorted(labels.items()))), 0)

    def observe_histogram(
        self, name: str, value: float, buckets: Iterable[float] = DURATION_BUCKETS, **labels: str
    ) -> None:
        """One observation of histogram ``name``: cumulative buckets, ``_sum``, ``_count``."""
        key = (name, _labels(labels))
        histogram = self._histograms.get(key)
        if histogram is None:
            histogram = self._histograms[key] = _Histogram(tuple(sorted(buckets)))
        histogram.observe(value)

    def inc(self, name: str, amount: Number = 1, **labels: str) -> None:
        key = (name, _labels(labels))
        self._values[key] = self._values.get(key, 0) + amount

    def observe(self, name: str, value: float, **labels: str) -> None:
        """One observation of summary ``name``: adds to ``name_sum``, counts in ``name_count``."""
        names = self._summaries.get(name)
        if names is None:
            names = self._summaries[name] = (f"{name}_sum", f"{name}_count")
        label_key = _labels(labels)
        values = self._values
        total, count = (names[0], label_key), (names[1], label_key)
        values[total] = values.get(total, 0) + value
        values[count] = values.get(count, 0) + 1

    def set(self, name: str, value: Number, **labels: str) -> None:
        self._values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels: str) -> Number:
        key = (name, tuple(sorted(labels.items())))
        if key in self._values:
            return self._values[key]
        return self.values.get(key, 0)

    def snapshot(self) -> list[list[object]]:
        return [[name, dict(labels), value] for (name, labels), value in self.values.items()]

    def write_snapshot(
        self, directory: str, health: tuple[bool, dict[str, Any]] | None = None
    ) -> None:
        """Write this process's metrics (and health) for a supervisor, atomically."""
        path = Path(directory) / f"{os.getpid()}.json"
        data: dict[str, Any] = {"metrics": self.snapshot(), "time": time.time()}
        if health is not None:
            data["health"] = {"ok": health[0], **health[1]}
        write_private_json(path, data)

    def render(self) -> str:
        return render({**self.values, **process_metrics()})


def worker_metrics() -> Metrics:
    """A worker's metrics, every fixed series present from the start."""
    metrics = Metrics()
    for outcome in OUTCOMES:
        metrics.zero("asyncgraph_worker_tasks_total", outcome=outcome)
    for reason in DEAD_LETTER_REASONS:
        metrics.zero("asyncgraph_worker_dead_letters_total", reason=reason)
    for name in (
        "asyncgraph_worker_reclaimed_total",
        "asyncgraph_worker_redis_errors_total",
        "asyncgraph_worker_task_seconds_sum",
        "asyncgraph_worker_task_seconds_count",
        "asyncgraph_worker_tasks_in_flight",
        "asyncgraph_worker_abandoned_calls",
    ):
        metrics.zero(name)
    for record in RECORDS:
        metrics.zero("asyncgraph_worker_ignored_records_total", record=record)
    metrics.zero("asyncgraph_worker_redis_refusals_total", code="OOM")
    return metrics


_START = time.time()


def process_metrics(pid: int | str = "self") -> dict[Key, Number]:
    """CPU, resident memory, open file descriptors and start time of a process, from /proc.

    Empty where /proc is not there (not Linux).
    """
    out: dict[Key, Number] = {}
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        out[("process_cpu_seconds_total", ())] = (int(stat[11]) + int(stat[12])) / ticks
        out[("process_resident_memory_bytes", ())] = int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
        out[("process_open_fds", ())] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return {}
    if pid == "self":
        out[("process_start_time_seconds", ())] = _START
    return out


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def merge_snapshots(paths: Iterable[Path], live: set[str]) -> dict[Key, Number]:
    """Sum children's snapshots: counters from every file, gauges from live children only."""
    total: dict[Key, Number] = {}
    for path in paths:
        data = _read(path)
        if data is None:
            continue
        for name, labels, value in data.get("metrics", ()):
            if _kind(name) == "gauge" and path.stem not in live:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = (str(name), tuple(sorted((str(k), str(v)) for k, v in labels.items())))
            total[key] = total.get(key, 0) + value
    return total


def read_health(directory: Path, pid: int, max_age_s: float) -> tuple[bool, str]:
    """A child's last health report: ``(ok, status)``; not ok when missing or older than ``max_age_s``."""
    data = _read(directory / f"{pid}.json")
    if data is None or not isinstance(data.get("health"), dict):
        return False, "no health report yet"
    age = time.time() - float(data.get("time", 0))
    if age > max_age_s:
        return False, f"no health report for {age:.0f}s"
    health = data["health"]
    return bool(health.get("ok")), str(health.get("status", "unknown"))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: Number) -> str:
    """A sample value, exact: ``1234567``, ``0.1``, ``1e+300``, ``NaN``, ``+Inf``."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(values: Mapping[Key, Number]) -> str:
    lines: list[str] = []
    by_family: dict[str, list[tuple[str, tuple[tuple[str, str], ...], Number]]] = {}
    for (name, labels), value in values.items():
        by_family.setdefault(_family(name), []).append((name, labels, value))
    for family in sorted(by_family):
        kind, text = HELP.get(family, ("gauge", family))
        lines.append(f"# HELP {family} {text}")
        lines.append(f"# TYPE {family} {kind}")
        for name, labels, value in sorted(by_family[family]):
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            sample = f"{name}{{{label_text}}}" if label_text else name
            lines.append(f"{sample} {format_value(value)}")
    return "\n".join(lines) + "\n"
