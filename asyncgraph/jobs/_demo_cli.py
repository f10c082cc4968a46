"""``asyncgraph demo``: the shipped prompt-optimization job, end to end.

``asyncgraph demo`` runs in-process on the simulated model; ``--workers N``
runs the backward on N local worker processes through an embedded Redis;
``--redis URL`` uses an existing Redis and its workers instead; ``--model
openai:MODEL --base-url URL`` switches to a real OpenAI-compatible endpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from ._checkpoint import CheckpointError
from ._runner import JobResult, run_job

__all__ = ["add_arguments", "run", "run_demo"]

DEMO_QUEUE = "asyncgraph-demo"
WORKER_IMPORTS = ("asyncgraph.text", "asyncgraph.jobs._demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="run backwards on N local worker processes (embedded redis-server)")
    parser.add_argument("--redis", metavar="URL",
                        help="use this Redis and the workers already serving it (queue --queue)")
    parser.add_argument("--queue", default=DEMO_QUEUE, help=f"worker queue (default: {DEMO_QUEUE})")
    parser.add_argument("--model", default="demo",
                        help="'demo' (simulated, offline; default) or openai:MODEL")
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for --model")
    parser.add_argument("--latency-ms", type=float, default=100.0,
                        help="simulated model latency per call (default 100)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", metavar="DIR", help="checkpoint/metrics directory (default: a temporary one)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")


async def run_demo(args: argparse.Namespace, out: Path) -> tuple[JobResult, dict[str, Any]]:
    from ..text import register_model, resolve_model
    from . import _demo
    from ._demo import build_demo_job

    simulated = args.model == "demo"
    if simulated:
        register_model(_demo.DEMO_MODEL, _demo.make_demo_model(args.latency_ms / 1000))
    job, prompt = build_demo_job(args.model, base_url=args.base_url, epochs=args.epochs)
    model = resolve_model(args.model, args.base_url)
    job.models = [model]  # type: ignore[list-item]
    before = prompt.data
    progress = not args.no_progress
    info: dict[str, Any] = {
        "before": before,
        "simulated": simulated,
        "latency_s": args.latency_ms / 1000 if simulated else None,
    }
    if args.workers and not args.redis:
        from ._fleet import local_fleet

        # The workers build their "demo" model at import, from this variable.
        os.environ[_demo.LATENCY_ENV] = str(args.latency_ms)
        with local_fleet(args.workers, WORKER_IMPORTS, queue=args.queue) as url:
            result = await _run_remote(job, out, url, args, progress)
    elif args.redis:
        result = await _run_remote(job, out, args.redis, args, progress)
    else:
        result = await run_job(job, out, resume=args.resume, progress=progress, handle_sigint=True)
    info["after"] = prompt.data
    info["local_calls"] = model.usage.snapshot().requests if hasattr(model, "usage") else None
    return result, info


async def _run_remote(job: Any, out: Path, url: str, args: argparse.Namespace, progress: bool) -> JobResult:
    from ..executors import open_redis_executor

    async with open_redis_executor(url, queue=args.queue, timeout_s=120.0) as executor:
        return await run_job(job, out, resume=args.resume, executor=executor, progress=progress,
                             handle_sigint=True)


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
    table.add_row("validation accuracy (exact match)", _pct(result.initial_val_score), _pct(result.final_val_score))
    table.add_row("system prompt", info["before"], info["after"])
    console.print(table)
    calls = info.get("local_calls")
    print(f"steps: {result.steps_done}   wall time: {wall_s:.1f}s   executor: {where}")
    if calls is not None:
        note = "" if where == "in-process" else " (the backward's calls ran on the workers)"
        print(f"model calls made in this process: {calls}{note}")
        latency_s = info.get("latency_s")
        if where == "in-process" and latency_s:
            sequential = calls * latency_s
            print(f"one call at a time they would take {sequential:.1f}s: "
                  f"{sequential / wall_s:.1f}x faster concurrently")
    print(f"checkpoint, history.json and metrics.png: {result.out_dir}")


def run(args: argparse.Namespace) -> int:
    if args.workers < 0:
        print("asyncgraph demo: --workers must be >= 0", file=sys.stderr)
        return 2
    if args.model != "demo" and not args.model.startswith("openai:"):
        print(f"asyncgraph demo: --model must be 'demo' or openai:MODEL, got {args.model!r}", file=sys.stderr)
        return 2
    where = (f"{args.workers} local worker processes via an embedded redis-server" if args.workers and not args.redis
             else f"workers of {args.redis}" if args.redis else "in-process")
    if args.model == "demo":
        print("asyncgraph demo: prompt optimization on 24 training / 16 validation questions.\n"
              "Model: SIMULATED (offline, scripted replies, not a language model; "
              f"{args.latency_ms:.0f} ms per call). Use --model openai:MODEL for a real one.")
    else:
        print(f"asyncgraph demo: prompt optimization with {args.model} at {args.base_url or 'the default endpoint'}")
    print(f"executor: {where}\n", flush=True)

    async def main() -> int:
        with tempfile.TemporaryDirectory(prefix="asyncgraph-demo-") as tmp:
            out = Path(args.out) if args.out else Path(tmp)
            start = time.perf_counter()
            try:
                result, info = await run_demo(args, out)
            except CheckpointError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            _table(result, info, time.perf_counter() - start, where)
            if not args.out:
                print("(pass --out DIR to keep them)")
            if result.interrupted:
                print("interrupted: the last completed step is checkpointed; rerun with --out DIR --resume")
                return 130
            return 0

    return anyio.run(main)
