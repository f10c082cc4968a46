"""``asyncgraph run path/to/job.py [--redis URL] [--resume] [--out DIR]``.

A job file is ordinary Python that defines ``build_job()`` (sync or async)
returning an :class:`asyncgraph.jobs.Job`. It is the user's own file, run as
they would run any script of theirs.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from ._checkpoint import CheckpointError
from ._runner import Job, JobResult, run_job

__all__ = ["add_arguments", "load_job_file", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_file", help="a Python file that defines build_job() -> Job")
    parser.add_argument("--redis", metavar="URL", help="run remote backwards on the workers of this Redis")
    parser.add_argument("--queue", default="grads", help="the workers' queue (default: grads)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--out", metavar="DIR", help="checkpoint/metrics directory (default: runs/<job name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")


def load_job_file(path: str | Path) -> ModuleType:
    """Import a job file by path (the user's own code) and return the module."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"job file {str(file)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"asyncgraph_job_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {str(file)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def build(module: ModuleType) -> Job:
    factory = getattr(module, "build_job", None)
    if factory is None or not callable(factory):
        raise AttributeError(
            f"{module.__file__} defines no build_job(); a job file defines "
            f"`def build_job() -> asyncgraph.jobs.Job` (may be async)"
        )
    job: Any = factory()
    if inspect.isawaitable(job):
        job = await job
    if not isinstance(job, Job):
        raise TypeError(f"build_job() must return asyncgraph.jobs.Job, got {job!r:.80}")
    return job


async def run_with_optional_redis(
    job: Job, out: Path, *, redis: str | None, queue: str, resume: bool, progress: bool
) -> JobResult:
    if redis is None:
        return await run_job(job, out, resume=resume, progress=progress, handle_sigint=True)
    from ..executors._redis import open_redis_executor

    async with open_redis_executor(redis, queue=queue) as executor:
        return await run_job(
            job, out, resume=resume, executor=executor, progress=progress, handle_sigint=True
        )


def run(args: argparse.Namespace) -> int:
    # A missing file or a file without build_job() is a usage error, not a crash of the
    # user's code: say so without a traceback.
    if not Path(args.job_file).is_file():
        print(f"error: job file {args.job_file!r} does not exist", file=sys.stderr)
        return 2

    async def main() -> int:
        module = load_job_file(args.job_file)
        if not callable(getattr(module, "build_job", None)):
            print(
                f"error: {args.job_file} defines no build_job(); a job file defines "
                f"`def build_job() -> asyncgraph.jobs.Job` (may be async)",
                file=sys.stderr,
            )
            return 2
        job = await build(module)
        out = Path(args.out) if args.out else Path("runs") / job.name
        try:
            result = await run_with_optional_redis(
                job, out, redis=args.redis, queue=args.queue, resume=args.resume,
                progress=not args.no_progress,
            )
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        summary(result)
        return 130 if result.interrupted else 0

    return anyio.run(main)


def summary(result: JobResult) -> None:
    state = "interrupted" if result.interrupted else "finished"
    print(
        f"{state} after {result.steps_done} step(s) in {result.wall_s:.1f}s; "
        f"checkpoint, history.json and metrics.png in {result.out_dir}"
    )
    if result.interrupted:
        print("resume with the same command plus --resume")
