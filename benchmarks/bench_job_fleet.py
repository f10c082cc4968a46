"""The forward on the fleet: a job whose metric burns 50 ms of CPU per example, with
``Job(forward_on_workers=True)``, on 1 and then 2 local worker processes.

    python benchmarks/bench_job_fleet.py [--burn-ms 50] [--rounds 2]

Each round runs the job on a fresh ``local_fleet`` of 1 worker, then of 2 (embedded
redis-server), checks that both give the same history and parameters as the job
in-process (run once, first), and prints the wall times and the speedup of 2 workers
over 1. ``uptime`` is printed before and after: the machine's load is part of the figure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from job_fleet_functions import BurnMetric  # noqa: E402

from asyncgraph import Parameter  # noqa: E402
from asyncgraph.distributed import local_fleet, open_redis_executor  # noqa: E402
from asyncgraph.jobs import Evaluation, Job, JobResult, run_job  # noqa: E402
from asyncgraph.optim import SGD  # noqa: E402

TRAIN = [{"x": 0.1 * i, "y": 2.5 * 0.1 * i} for i in range(1, 33)]
VAL = [{"x": 0.15 * i, "y": 2.5 * 0.15 * i} for i in range(1, 9)]
QUEUE = "bench-job-fleet"


def build_job(on_workers: bool) -> Job:
    """32 training examples in 4 steps of 8, 8 validation examples validated 5 times:
    72 metric forwards (and 32 backwards)."""
    w = Parameter(0.0, role="slope")

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        loss = await BurnMetric.apply(w, example["x"], example["y"])
        return Evaluation(loss=loss, score=float(loss.data < 0.01))

    return Job(
        name="burn",
        parameters=[w],
        optimizer=SGD([w], lr=0.5),
        forward=forward,
        train_set=TRAIN,
        val_set=VAL,
        batch_size=8,
        max_concurrency=16,
        forward_on_workers=on_workers,
    )


def comparable(result: JobResult) -> tuple[Any, ...]:
    rows = [{k: v for k, v in row.items() if k != "step_s"} for row in result.history]
    return rows, result.parameters


async def on_fleet(url: str, out: Path) -> tuple[float, JobResult]:
    async with open_redis_executor(url, queue=QUEUE) as executor:
        t0 = time.perf_counter()
        result = await run_job(build_job(True), out, executor=executor, progress=False)
        return time.perf_counter() - t0, result


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burn-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="tasks a worker holds at once (default 1: one CPU-bound metric per process)",
    )
    args = parser.parse_args()
    os.environ["BENCH_BURN_MS"] = str(args.burn_ms)  # the workers read it at import
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    print(f"uptime before: {uptime()}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        reference = anyio.run(lambda: run_job(build_job(False), Path(tmp, "here"), progress=False))
        print(f"in-process: {time.perf_counter() - t0:.2f} s (72 forwards x {args.burn_ms:g} ms)")
        for round_ in range(1, args.rounds + 1):
            walls = {}
            for workers in (1, 2):
                with local_fleet(
                    workers,
                    ["job_fleet_functions"],
                    queue=QUEUE,
                    secret="",
                    concurrency=args.concurrency,
                ) as url:
                    out = Path(tmp, f"r{round_}-w{workers}")
                    walls[workers], result = anyio.run(on_fleet, url, out)
                assert result.forward_on == "workers"
                assert comparable(result) == comparable(reference), "differs from in-process"
            print(
                f"round {round_}: 1 worker {walls[1]:.2f} s, 2 workers {walls[2]:.2f} s: "
                f"speedup {walls[1] / walls[2]:.2f}x (history and parameters = in-process)"
            )
    print(f"uptime after: {uptime()}")


if __name__ == "__main__":
    main()
