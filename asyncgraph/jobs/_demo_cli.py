"""``asyncgraph demo``: the shipped prompt-optimization job, end to end.

``asyncgraph demo`` runs in-process on the simulated model; ``--workers N``
runs the backward on N local worker processes through an embedded Redis (a
random password for the server and a random task-signing secret, or the user's
``ASYNCGRAPH_SECRET``; the workers may call the ``--base-url`` given);
``--redis URL`` uses an existing Redis and its workers instead (it must have a
live worker); ``--model openai:MODEL --base-url URL`` switches to a real
OpenAI-compatible endpoint. Outputs are kept only with ``--out DIR``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncgraph._redact import redact, redact_url

from ._checkpoint import CheckpointError
from ._cli_common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    add_cost_cap_argument,
    add_observe_arguments,
    add_start_arguments,
    already_finished_line,
    check_live_workers,
    existing_run_problem,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_spending,
    redis_problem,
    run_command,
    run_job_options,
    usage_error,
)
from ._job import Job, JobResult
from ._run_cli import add_logging, add_max_attempts, apply_logging, apply_max_attempts, outputs

__all__ = ["add_arguments", "run", "run_demo"]

DEMO_QUEUE = "asyncgraph-demo"
SECRET_ENV = "ASYNCGRAPH_SECRET"  # the workers' and clients' shared secret
WORKER_IMPORTS = ("asyncgraph.text", "asyncgraph.jobs.demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--workers",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="run backwards on N local worker processes (embedded redis-server); 0, the "
        "default, runs everything in this process",
    )
    where.add_argument(
        "--redis",
        metavar="URL",
        help="use this Redis and the workers already serving it (queue --queue)",
    )
    parser.add_argument("--queue", default=DEMO_QUEUE, help=f"worker queue (default: {DEMO_QUEUE})")
    parser.add_argument(
        "--model",
        default="demo",
        help="'demo' or 'simulated' (the demo's scripted simulated model, offline; default), "
        "or any model spec the library takes: openai:MODEL, anthropic:MODEL, "
        "azure:DEPLOYMENT, litellm:MODEL",
    )
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --model")
    parser.add_argument(
        "--latency-ms",
        type=non_negative_float,
        default=100.0,
        help="simulated model latency per call (default 100)",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        default=2,
        metavar="N",
        help="passes over the 24 training questions, 3 steps each (default: 2)",
    )
    add_max_attempts(parser)
    add_logging(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="keep the checkpoint, history.json and metrics.png in DIR "
        "(default: a temporary directory, discarded at the end)",
    )
    add_start_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    add_cost_cap_argument(parser)
    add_observe_arguments(parser)


def _build(args: argparse.Namespace) -> tuple[Job, Any, dict[str, Any]]:
    """The demo's job, its prompt, and what the summary needs to know of the run."""
    from . import demo as _demo
    from .demo import build_demo_job

    simulated = args.model == _demo.DEMO_MODEL
    job, prompt = build_demo_job(
        args.model,
        base_url=args.base_url,
        epochs=args.epochs,
        latency_ms=args.latency_ms if simulated else None,
    )
    if args.max_cost is not None:
        job.max_cost_usd = args.max_cost
    info: dict[str, Any] = {
        "before": prompt.data,
        "simulated": simulated,
        "latency_s": args.latency_ms / 1000 if simulated else None,
    }
    return job, prompt, info


def _finished_before_start(args: argparse.Namespace, job: Job, out: Path) -> JobResult | None:
    """Check ``out`` before anything starts (no banner, no fleet): CheckpointError for an
    earlier run without --resume / --overwrite or another job's checkpoint; with --resume,
    the result of a run that has nothing left to do (a fleet would start for nothing)."""
    problem = existing_run_problem(
        out, resume=args.resume, overwrite=getattr(args, "overwrite", False), job=job
    )
    if problem is not None:
        raise CheckpointError(problem)
    if not args.resume:
        return None
    from ._runner import finished_run

    return finished_run(job, out)


async def run_demo(
    args: argparse.Namespace,
    out: Path,
    built: tuple[Job, Any, dict[str, Any]] | None = None,
) -> tuple[JobResult, dict[str, Any]]:
    """The demo's run in ``out``; ``built``: the job ``_build`` made and ``out`` was
    checked for (``run`` does both before its banner), else both happen here."""
    from ..models import track_usage
    from . import demo as _demo
    from ._runner import run_job

    if built is None:
        built = _build(args)
        done = _finished_before_start(args, built[0], out)
        if done is not None:
            return done, built[2]
    job, prompt, info = built
    with track_usage() as usage:  # every model call, the workers' included
        if args.workers and not args.redis:
            from asyncgraph.distributed import local_fleet

            # The workers build their "demo" model at import, from this variable.
            os.environ[_demo.LATENCY_ENV] = str(args.latency_ms)
            # Signed tasks: another local user who reached the fleet's Redis could not
            # have the workers call a model with their API key. The user's secret if set.
            secret = os.environ.get(SECRET_ENV, "").strip() or secrets.token_hex(32)
            with local_fleet(
                args.workers,
                WORKER_IMPORTS,
                queue=args.queue,
                secret=secret,
                allowed_base_urls=[args.base_url] if args.base_url else [],
            ) as url:
                result = await _run_remote(job, out, url, args, secret)
        elif args.redis:
            result = await _run_remote(job, out, args.redis, args, None)
        else:
            result = await run_job(job, out, **run_job_options(args))
    info["after"] = prompt.data
    info["calls"] = usage.snapshot().requests
    return result, info


async def _run_remote(
    job: Any, out: Path, url: str, args: argparse.Namespace, secret: str | None
) -> JobResult:
    """``job`` on the workers at ``url``; ``secret``: theirs (None: ``$ASYNCGRAPH_SECRET``)."""
    from asyncgraph.distributed import open_redis_executor

    from ._runner import run_job

    async with open_redis_executor(
        url, queue=args.queue, timeout_s=120.0, secret=secret
    ) as executor:
        return await run_job(job, out, executor=executor, **run_job_options(args))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _table(result: JobResult, info: dict[str, Any], wall_s: float, where: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="asyncgraph demo: before / after", show_lines=True)
    table.add_column("")
    table.add_column("before")
    table.add_column("after")
    table.add_row(
        "validation accuracy (exact match)",
        _pct(result.initial_val_score),
        _pct(result.final_val_score),
    )
    table.add_row("system prompt", info["before"], info["after"])
    console.print(table)
    calls = info["calls"]
    print(f"steps: {result.steps_done}   wall time: {wall_s:.1f}s   executor: {where}")
    note = "" if where == "in-process" else " (the workers' included)"
    print(f"model calls: {calls}{note}")
    latency_s = info.get("latency_s")
    if latency_s and calls and calls * latency_s > wall_s:
        sequential = calls * latency_s
        print(
            f"one call at a time they would take {sequential:.1f}s: "
            f"{sequential / wall_s:.1f}x faster concurrently"
        )
    if where != "in-process" and info.get("simulated"):
        print(WORKERS_NOTE)


# What the summary of a fleet run of the simulated demo says (docs/cli/demo.md: "When
# `--workers` pays").
WORKERS_NOTE = (
    "note: on one machine the simulated demo runs faster in-process: its calls only wait, "
    "so worker processes add their start and Redis round trips and save nothing. Workers "
    "pay when model calls block a thread, metrics are CPU-bound, or workers run on "
    "several machines."
)


def _simulated_spec(args: argparse.Namespace) -> str | None:
    """``--model simulated`` / ``simulated:LATENCY_S`` (the library's spec for the offline
    model) is the demo's own simulated model: ``args.model`` becomes 'demo' (and the
    latency the spec's). What is wrong with the spec, or None."""
    provider, _, latency = args.model.partition(":")
    if provider.strip().lower() != "simulated":
        return None
    if latency:
        try:
            seconds = float(latency)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0:
            return (
                f"--model {args.model!r}: the simulated latency must be a number of seconds "
                f">= 0, e.g. simulated:0.05"
            )
        args.latency_ms = seconds * 1000
    args.model = "demo"
    return None


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the combination of options, or None (argparse checked each one)."""
    problem = _simulated_spec(args)
    if problem is not None:
        return problem
    if args.model == "demo" and args.base_url is not None:
        return (
            "--base-url is for a real model (--model openai:MODEL); the simulated 'demo' "
            "model makes no requests"
        )
    if args.model != "demo":
        # The model is built now (no request is made): a bad spec (with the library's
        # suggestion, e.g. 'openai:gpt-4o-mini' for 'gpt-4o-mini'), a missing API key or a
        # bad base URL is reported before any step, not at the first call.
        from ..models import BaseChatModel, parse_model_spec

        try:
            model = parse_model_spec(args.model, base_url=args.base_url)
        except (ValueError, ImportError) as exc:
            return str(exc)  # the library's words, which name the spec and lead with the fix
        keys = model.missing_api_keys() if isinstance(model, BaseChatModel) else []
        if keys:  # LiteLLM reads the provider's variables itself, at the first call
            return (
                f"{' or '.join(keys)} is not set: LiteLLM needs it to call {args.model!r}. "
                "Set it, or give --base-url for a server that needs no key"
            )
    if args.workers and len(os.environ.get(SECRET_ENV, "").strip().encode()) in range(1, 16):
        return (
            f"{SECRET_ENV} must be at least 16 bytes long (the demo's workers sign with it); "
            "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    if args.resume and not args.out:
        return (
            "--resume needs --out DIR: without --out the demo writes to a temporary "
            "directory that is deleted at the end, so there is nothing to resume"
        )
    return redis_problem(args.redis, args.queue)


def run(args: argparse.Namespace) -> int:
    problem = _usage_problem(args)
    if problem is not None:
        return usage_error(problem)
    apply_max_attempts(args)
    apply_logging(args)
    where = (
        f"{args.workers} local worker processes via an embedded redis-server"
        if args.workers
        else f"workers of {redact_url(args.redis)}"
        if args.redis
        else "in-process"
    )

    async def main() -> int:
        built = _build(args)
        if args.out:  # a bad --out says so before the banner; a finished run starts nothing
            done = _finished_before_start(args, built[0], Path(args.out))
            if done is not None:
                print(already_finished_line(done))
                return 0
        if args.redis:
            missing = await check_live_workers(args.redis, args.queue, WORKER_IMPORTS)
            if missing is not None:
                print(f"error: {missing}", file=sys.stderr)
                return EXIT_ERROR
        if args.model == "demo":
            print(
                "asyncgraph demo: prompt optimization on 24 training / 16 validation questions.\n"
                "Model: SIMULATED (offline, scripted replies, not a language model; "
                f"{args.latency_ms:.0f} ms per call). Use --model openai:MODEL for a real one."
            )
        else:
            print(
                f"asyncgraph demo: prompt optimization with {args.model} at "
                f"{redact_url(args.base_url) if args.base_url else 'the default endpoint'}"
            )
        print(f"executor: {where}\n", flush=True)
        with tempfile.TemporaryDirectory(prefix="asyncgraph-demo-") as tmp:
            out = Path(args.out) if args.out else Path(tmp)
            start = time.perf_counter()
            result, info = await run_demo(args, out, built)
            if result.already_finished:  # as `asyncgraph run --resume` says it
                print(already_finished_line(result))
                return 0
            _table(result, info, time.perf_counter() - start, where)
            return _summary(args, result)

    return run_command(main)


def _summary(args: argparse.Namespace, result: JobResult) -> int:
    """The lines after the table: spend, the best prompt, the outputs, an interruption."""
    print_spending(result)
    if result.best_val_score is not None and result.best_parameters is not None:
        when = "the initial prompt" if result.best_step == 0 else f"after step {result.best_step}"
        print(
            f"best validation accuracy: {_pct(result.best_val_score)} ({when})"
            + (f", saved in {result.best_path}" if args.out and result.best_path else "")
        )
        print(f"best system prompt: {redact(str(result.best_parameters[0]))}")
    if args.out:
        print(f"{outputs(result)}: {result.out_dir}")
    else:
        print(
            f"{outputs(result)} went to a temporary directory and are discarded "
            f"(pass --out DIR to keep them)"
        )
    if not result.interrupted:
        return 0
    if args.out:
        print(
            "interrupted: the last completed step is checkpointed; resume with the "
            "same command plus --resume" + (" (instead of --overwrite)" if args.overwrite else "")
        )
    else:
        print("interrupted: nothing is kept without --out DIR, so this run cannot be resumed")
    return EXIT_INTERRUPTED
