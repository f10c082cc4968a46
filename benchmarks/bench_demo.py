"""Wall time of ``asyncgraph demo`` in-process and on 2 and 4 local workers.

Prints, in one run, the demo job's wall time on each executor next to the
sequential time of its model calls (the number of calls the in-process run
made, read from the model's usage meter, times the simulated latency: what
making them one after another would cost) and the ratio sequential / wall.

Every run goes through the CLI's own code (``asyncgraph.jobs._demo_cli.run_demo``,
the path of ``asyncgraph demo`` and ``asyncgraph demo --redis URL``). For the
worker runs the fleet (an embedded redis-server and N worker processes, as
``--workers N`` starts) is started first and its start-up time is printed
separately, not counted in the job's wall time. All runs must end with the same
prompt and metrics; the benchmark exits 1 if they do not.

    python benchmarks/bench_demo.py [--latency-ms 100] [--workers 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from asyncgraph.distributed._fleet import local_fleet
from asyncgraph.jobs import demo as _demo
from asyncgraph.jobs._demo_cli import WORKER_IMPORTS, add_arguments, run_demo
from asyncgraph.text import resolve_model

COMPARED = ("step", "epoch", "train_score", "train_loss", "val_score")


def demo_args(latency_ms: float, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--latency-ms", str(latency_ms), "--no-progress", *extra])


def run_once(args: argparse.Namespace) -> tuple[float, Any, int]:
    """(wall seconds, result, model calls made in this process) of one demo run."""

    async def main() -> tuple[float, Any, int]:
        with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
            start = time.perf_counter()
            result, _info = await run_demo(args, Path(tmp))
            wall = time.perf_counter() - start
        model: Any = resolve_model(_demo.DEMO_MODEL)  # the demo's SimulatedModel: metered
        calls = model.usage.snapshot().requests
        return wall, result, int(calls)

    return anyio.run(main)


def outcome(result: Any) -> tuple[Any, ...]:
    rows = tuple(tuple(h[k] for k in COMPARED) for h in result.history)
    return (tuple(result.parameters), result.initial_val_score, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4])
    opts = parser.parse_args()
    latency_s = opts.latency_ms / 1000
    # The workers build their "demo" model at import, with this latency (as --workers does).
    os.environ[_demo.LATENCY_ENV] = str(opts.latency_ms)

    wall, result, calls = run_once(demo_args(opts.latency_ms))
    sequential = calls * latency_s
    reference = outcome(result)
    rows: list[tuple[str, float, float | None]] = [("in-process", wall, None)]
    same = True
    for n in opts.workers:
        queue = f"bench-demo-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        with local_fleet(n, WORKER_IMPORTS, queue=queue) as url:
            startup = time.perf_counter() - started
            wall_n, result_n, _ = run_once(
                demo_args(opts.latency_ms, "--redis", url, "--queue", queue)
            )
        rows.append((f"{n} workers (embedded redis)", wall_n, startup))
        same = same and outcome(result_n) == reference

    print(
        f"asyncgraph demo benchmark: simulated model, {opts.latency_ms:g} ms per call, "
        f"{result.steps_done} steps of 8 questions, validation on 16 after each"
    )
    print(
        f"model calls (in-process run's usage): {calls}; one after another they take "
        f"{calls} x {latency_s:g} s = {sequential:.1f} s\n"
    )
    print(
        f"{'executor':<28} {'wall':>8} {'sequential':>11} {'sequential/wall':>16} {'fleet start':>12}"
    )
    for name, wall_s, fleet_start_s in rows:
        start_text = "-" if fleet_start_s is None else f"{fleet_start_s:.1f} s"
        print(
            f"{name:<28} {wall_s:>6.2f} s {sequential:>9.1f} s {sequential / wall_s:>15.1f}x "
            f"{start_text:>12}"
        )
    print(f"\nsame final prompt and metrics on every executor: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
