"""``asyncgraph run path/to/job.py [--redis URL] [--resume | --overwrite] [--out DIR]``.

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

from ._cli_common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    add_observe_arguments,
    check_live_workers,
    redis_problem,
    run_command,
    usage_error,
)
from ._runner import Job, JobResult, run_job

__all__ = ["add_arguments", "load_job_file", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_file", help="a Python file that defines build_job() -> Job")
    parser.add_argument(
        "--redis", metavar="URL", help="run remote backwards on the workers of this Redis"
    )
    parser.add_argument("--queue", default="grads", help="the workers' queue (default: grads)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start over even if --out holds a checkpoint (it is replaced)",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="checkpoint/metrics directory (default: runs/<job name>)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    add_observe_arguments(parser)


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
    job: Job,
    out: Path,
    *,
    redis: str | None,
    queue: str,
    resume: bool,
    progress: bool,
    overwrite: bool = False,
    trace: bool = False,
    log_calls: str | None = None,
) -> JobResult:
    if redis is None:
        return await run_job(
            job,
            out,
            resume=resume,
            overwrite=overwrite,
            progress=progress,
            handle_sigint=True,
            trace=trace,
            log_calls=log_calls,
        )
    from ..executors._redis import open_redis_executor

    async with open_redis_executor(redis, queue=queue) as executor:
        return await run_job(
            job,
            out,
            resume=resume,
            overwrite=overwrite,
            executor=executor,
            progress=progress,
            handle_sigint=True,
            trace=trace,
            log_calls=log_calls,
        )


def run(args: argparse.Namespace) -> int:
    # A missing file or a file without build_job() is a usage error, not a crash of the
    # user's code: say so without a traceback.
    if not Path(args.job_file).is_file():
        return usage_error(f"job file {args.job_file!r} does not exist")
    problem = redis_problem(args.redis, args.queue)
    if problem is not None:
        return usage_error(problem)

    async def main() -> int:
        if args.redis is not None:
            # Before the job starts: otherwise every remote node would wait for the
            # executor's timeout before saying that nobody serves the queue.
            missing = await check_live_workers(args.redis, args.queue, ("MODULE",))
            if missing is not None:
                print(f"error: {missing}", file=sys.stderr)
                return EXIT_ERROR
        module = load_job_file(args.job_file)
        if not callable(getattr(module, "build_job", None)):
            return usage_error(
                f"{args.job_file} defines no build_job(); a job file defines "
                f"`def build_job() -> asyncgraph.jobs.Job` (may be async)"
            )
        job = await build(module)
        out = Path(args.out) if args.out else Path("runs") / job.name
        result = await run_with_optional_redis(
            job,
            out,
            redis=args.redis,
            queue=args.queue,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            trace=args.trace,
            log_calls=args.log_calls,
        )
        summary(result, overwrite=args.overwrite)
        return EXIT_INTERRUPTED if result.interrupted else 0

    return run_command(main)


def outputs(result: JobResult) -> str:
    """What the job left in its directory (metrics.png only if it was drawn)."""
    names = ["checkpoint", "history.json"]
    if result.plot_path is not None:
        names.append("metrics.png")
    return f"{', '.join(names[:-1])} and {names[-1]}"


def summary(result: JobResult, *, overwrite: bool = False) -> None:
    state = "interrupted" if result.interrupted else "finished"
    print(
        f"{state} after {result.steps_done} step(s) in {result.wall_s:.1f}s; "
        f"{outputs(result)} in {result.out_dir}"
    )
    if result.interrupted:
        print(
            "resume with the same command plus --resume"
            + (" (instead of --overwrite)" if overwrite else "")
        )
