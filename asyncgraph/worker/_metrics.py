"""Worker counters and gauges, rendered in the Prometheus text exposition format.

No dependency: a worker from a plain ``pip install`` serves ``/metrics``.
Under ``--processes N`` each child writes its snapshot to a file in the
supervisor's directory once a second and the supervisor sums them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["Metrics", "merge_snapshots", "render"]

HELP: dict[str, tuple[str, str]] = {
    "asyncgraph_worker_tasks_total": ("counter", "Tasks finished, by outcome."),
    "asyncgraph_worker_dead_letters_total": ("counter", "Messages dead-lettered, by reason."),
    "asyncgraph_worker_reclaimed_total": ("counter", "Tasks reclaimed from workers whose lease expired."),
    "asyncgraph_worker_redis_errors_total": ("counter", "Redis calls that failed."),
    "asyncgraph_worker_task_seconds_sum": ("counter", "Total seconds spent running tasks."),
    "asyncgraph_worker_task_seconds_count": ("counter", "Tasks run (for the mean duration)."),
    "asyncgraph_worker_tasks_in_flight": ("gauge", "Tasks read and not yet acknowledged."),
    "asyncgraph_worker_processes": ("gauge", "Worker processes alive."),
    "asyncgraph_worker_restarts_total": ("counter", "Worker processes restarted by the supervisor."),
}

Key = tuple[str, tuple[tuple[str, str], ...]]


class Metrics:
    """Counters and gauges with labels; ``render()`` gives the exposition text."""

    def __init__(self) -> None:
        self.values: dict[Key, float] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def snapshot(self) -> list[list[object]]:
        return [[name, dict(labels), value] for (name, labels), value in self.values.items()]

    def write_snapshot(self, directory: str) -> None:
        path = Path(directory) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        tmp.replace(path)

    def render(self) -> str:
        return render(self.values)


def merge_snapshots(paths: Iterable[Path], live: set[str]) -> dict[Key, float]:
    """Sum children's snapshots: counters from every file, gauges from live children only."""
    total: dict[Key, float] = {}
    for path in paths:
        try:
            items = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for name, labels, value in items:
            kind = HELP.get(name, ("gauge", ""))[0]
            if kind == "gauge" and path.stem not in live:
                continue
            key = (str(name), tuple(sorted((str(k), str(v)) for k, v in labels.items())))
            total[key] = total.get(key, 0.0) + float(value)
    return total


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(values: Mapping[Key, float]) -> str:
    lines: list[str] = []
    by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
    for (name, labels), value in values.items():
        by_name.setdefault(name, []).append((labels, value))
    for name in sorted(by_name):
        kind, text = HELP.get(name, ("gauge", name))
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {'counter' if kind == 'counter' else 'gauge'}")
        for labels, value in sorted(by_name[name]):
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{name}{{{label_text}}} {value:g}" if label_text else f"{name} {value:g}")
    return "\n".join(lines) + "\n"
