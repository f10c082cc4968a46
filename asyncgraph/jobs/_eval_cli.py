"""``asyncgraph eval path/to/job.py [--params best.json] [--split test|val|train]
[--redis URL | --workers N]``.

Builds the job from its file (``build_job()``, as ``asyncgraph run`` does), loads saved
parameter values into it (a run's ``best.json`` or ``checkpoint.json``, or a file written
by ``Module.save``), and prints the mean score of the job's forward over one split,
without gradients. The default split is the job's ``test_set`` if it has one, else its
``val_set``.

For a job with ``Job(forward_on_workers=True)``, ``--redis URL`` or ``--workers N`` (the
flags of ``asyncgraph run``, read by the same code) run the forwards of its remote
Functions on the workers, inside ``asyncgraph.remote_forwards(executor)``; the output
says where the forwards ran. A job without the switch has nothing to send there: the
flags are then a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncgraph import remote_forwards

from ._checkpoint import BEST_FORMAT, load_parameters
from ._cli_common import run_command, usage_error
from ._job import Job
from ._run_cli import (
    JobFileError,
    add_fleet_arguments,
    add_logging,
    add_max_attempts,
    apply_logging,
    apply_max_attempts,
    fleet_problem,
    job_file_problem,
    load_job,
    open_fleet,
)

__all__ = ["SPLITS", "add_arguments", "run"]

SPLITS = ("test", "val", "train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_file", help="a Python file that defines build_job() -> Job")
    parser.add_argument(
        "--params",
        metavar="PATH",
        help="parameter values to score: a run's best.json or checkpoint.json, or a "
        "Module.save file (default: the values build_job() gives)",
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        help="the examples to score on (default: test if the job has a test_set, else val)",
    )
    add_fleet_arguments(
        parser, sent="the remote forwards of a job with Job(forward_on_workers=True)"
    )
    add_max_attempts(parser)
    add_logging(parser)


def _split(job: Job, name: str | None) -> tuple[str, list[Mapping[str, Any]]] | str:
    """The split's name and examples, or the problem with it."""
    sets = {"test": job.test_set, "val": job.val_set, "train": job.train_set}
    if name is None:
        name = "test" if job.test_set else "val"
    examples = list(sets[name])
    if not examples:
        others = [n for n in SPLITS if sets[n] and n != name]
        return (
            f"job {job.name!r} has no {name} examples ({name}_set is empty); choose "
            f"--split {' or --split '.join(others)}"
        )
    return name, examples


def _process_started() -> float:
    """When this process started, on ``time.perf_counter``'s clock: the command's wall time
    counts Python's start-up and the CLI's imports too (Linux's /proc; elsewhere, now)."""
    now = time.perf_counter()
    try:
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            # Field 22 (starttime, clock ticks after boot), after the ")" that ends field 2.
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])
            age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - max(0.0, age)


def run(args: argparse.Namespace) -> int:
    command_started = _process_started()
    problem = job_file_problem(args.job_file) or fleet_problem(args)
    if problem is not None:
        return usage_error(problem)
    if args.params is not None and not Path(args.params).is_file():
        return usage_error(f"--params {args.params!r}: no such file")
    apply_max_attempts(args)
    apply_logging(args)

    async def main() -> int:
        loaded = await load_job(args)
        if isinstance(loaded, int):
            return loaded
        module, job = loaded
        if (args.redis or args.workers) and not job.forward_on_workers:
            return usage_error(
                f"job {job.name!r} runs its forwards in this process (it does not set "
                f"Job(forward_on_workers=True)), and eval sends nothing else to workers: "
                f"drop --redis / --workers, or set forward_on_workers=True in build_job()"
            )
        chosen = _split(job, args.split)
        if isinstance(chosen, str):
            return usage_error(chosen)
        name, examples = chosen
        source = "the values build_job() gives"
        if args.params is not None:
            saved = load_parameters(job, args.params)
            source = str(args.params)
            if saved.get("format") == BEST_FORMAT:
                score = saved.get("val_score")
                shown = "not measured" if score is None else f"{score:.2f}"
                source += f" (step {saved.get('step')}, validation {shown})"
        from ._runner import evaluate, forwards_executor  # loads the optimizers, models

        started = time.perf_counter()
        try:
            async with open_fleet(args, module.__name__) as executor:
                forwards = forwards_executor(job, executor)
                with remote_forwards(forwards):
                    score = await evaluate(job, examples)
        except JobFileError as exc:  # the job file's Functions cannot be served
            return usage_error(str(exc))
        print(f"job: {job.name}")
        print(f"parameters: {source}")
        print(f"split: {name} ({len(examples)} examples)")
        print(f"forwards: {'on the workers' if forwards is not None else 'in-process'}")
        print(f"score: {score:.4f}  (mean of the job's per-example scores)")
        # The evaluation alone can take milliseconds where the command took a second
        # (start-up, loading the job file, a fleet's connection): both are said.
        now = time.perf_counter()
        print(
            f"wall time: {now - command_started:.1f}s (evaluation {now - started:.2f}s)",
            file=sys.stderr,
        )
        return 0

    return run_command(main)
