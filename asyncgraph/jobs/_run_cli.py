"""``asyncgraph run path/to/job.py [--redis URL | --workers N] [--resume | --overwrite] [--out DIR]``.

A job file is ordinary Python that defines ``build_job()`` (sync or async)
returning an :class:`asyncgraph.jobs.Job`. It is the user's own file, run as
they would run any script of theirs. ``--workers N`` starts N local worker
processes (an embedded redis-server, as ``asyncgraph demo --workers N`` does)
serving the modules of the remote Functions the job file loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncgraph import AsyncGraphError
from asyncgraph._exceptions import JobFileError
from asyncgraph._redact import redact

from ._checkpoint import CHECKPOINT_FILE, CheckpointError, holds_no_step
from ._cli_common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    add_cost_cap_argument,
    add_observe_arguments,
    add_start_arguments,
    already_finished_line,
    check_live_workers,
    existing_run_problem,
    positive_int,
    print_spending,
    redis_problem,
    run_command,
    run_job_options,
    usage_error,
)
from ._job import Job, JobResult

__all__ = ["JobFileError", "add_arguments", "best_line", "load_job_file", "print_best", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_file", help="a Python file that defines build_job() -> Job")
    add_fleet_arguments(
        parser,
        sent="remote backwards (and, with Job(forward_on_workers=True), remote forwards)",
    )
    add_start_arguments(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help=f"checkpoint/metrics directory (default: {DEFAULT_RUNS_DIR}/<job name>, announced)",
    )
    add_max_attempts(parser)
    add_logging(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    add_cost_cap_argument(parser)
    add_observe_arguments(parser)


DEFAULT_RUNS_DIR = "runs"


def _where(exc: BaseException, file: Path) -> str:
    """`` (file:line)`` for the deepest frame of ``exc`` in the job file, else ``""``."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if os.path.abspath(f.filename) == os.path.abspath(file)
    ]
    return f" ({file}:{frames[-1].lineno})" if frames else ""


def _syntax_error(exc: SyntaxError, file: Path) -> JobFileError:
    """A SyntaxError as ``file:line:col: message`` with the line and a caret under it."""
    text = (exc.text or "").rstrip("\n")
    stripped = text.lstrip()
    caret = ""
    if stripped and exc.offset:
        column = max(0, exc.offset - 1 - (len(text) - len(stripped)))
        caret = f"\n    {stripped}\n    {' ' * column}^"
    return JobFileError(f"{file}:{exc.lineno}:{exc.offset or 0}: SyntaxError: {exc.msg}{caret}")


def job_file_problem(path: str | Path) -> str | None:
    """What makes ``path`` unusable as a job file before reading it, or None."""
    file = Path(path)
    if file.is_dir():
        return (
            f"{str(file)!r} is a directory, not a job file: pass the Python file that "
            f"defines build_job(), e.g. {str(file / 'job.py')!r}"
        )
    if not file.exists():
        return f"job file {str(file)!r} does not exist"
    if not file.is_file():
        return f"{str(file)!r} is not a regular file: pass a Python file that defines build_job()"
    return None


def load_job_file(path: str | Path) -> ModuleType:
    """Import a job file by path (the user's own code) and return the module.

    Raises ``JobFileError`` (one line saying what and where) when the file is missing,
    does not compile, or raises while it is imported.
    """
    file = Path(path)
    problem = job_file_problem(file)
    if problem is not None:
        raise JobFileError(problem)
    spec = importlib.util.spec_from_file_location(f"asyncgraph_job_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise JobFileError(f"cannot load {str(file)!r} as a Python file (does it end in .py?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(spec.name, None)
        raise _syntax_error(exc, file) from exc
    except Exception as exc:
        sys.modules.pop(spec.name, None)
        raise JobFileError(
            f"job file {str(file)!r} raised {type(exc).__name__} while it was imported"
            f"{_where(exc, file.resolve())}: {exc}"
        ) from exc
    return module


async def build(module: ModuleType) -> Job:
    """Call the job file's ``build_job()``; ``JobFileError`` for anything wrong with it."""
    file = Path(str(module.__file__))
    factory = getattr(module, "build_job", None)
    if factory is None or not callable(factory):
        raise JobFileError(
            f"{file} defines no build_job(); a job file defines "
            f"`def build_job() -> asyncgraph.jobs.Job` (may be async)"
        )
    try:
        job: Any = factory()
        if inspect.isawaitable(job):
            job = await job
    except AsyncGraphError:  # ours (model errors included): reported as they are
        raise
    except Exception as exc:
        raise JobFileError(
            f"build_job() in {file} raised {type(exc).__name__}{_where(exc, file)}: {exc}"
        ) from exc
    if not isinstance(job, Job):
        raise JobFileError(
            f"build_job() in {file} must return an asyncgraph.jobs.Job, got "
            f"{type(job).__name__}: {job!r:.80}"
        )
    return job


async def load_job(args: argparse.Namespace) -> tuple[ModuleType, Job] | int:
    """``args.job_file`` loaded and its job built, once the fleet's queue is known to be
    served (``--redis``); or, said on stderr, the exit code of what went wrong."""
    missing = await unserved_queue(args)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_ERROR
    try:
        module = load_job_file(args.job_file)
        return module, await build(module)
    except JobFileError as exc:
        return usage_error(str(exc))


def run(args: argparse.Namespace) -> int:
    # A missing file or a file without build_job() is a usage error, not a crash of the
    # user's code: say so without a traceback.
    problem = job_file_problem(args.job_file) or fleet_problem(args)
    if problem is not None:
        return usage_error(problem)
    apply_max_attempts(args)
    apply_logging(args)
    used_out: list[Path] = []  # the run directory, once the job is built

    async def main() -> int:
        loaded = await load_job(args)
        if isinstance(loaded, int):
            return loaded
        module, job = loaded
        if args.max_cost is not None:
            job.max_cost_usd = args.max_cost
        out = Path(args.out) if args.out else Path(DEFAULT_RUNS_DIR) / job.name
        if not args.out:
            announce_default_out(out)
        used_out.append(out)
        # Before any worker starts: one would go unused.
        problem = existing_run_problem(out, resume=args.resume, overwrite=args.overwrite, job=job)
        if problem is not None:
            raise CheckpointError(problem)
        from ._runner import finished_run, run_job  # the optimizers and models load here

        # A finished run resumed has nothing to do: no fleet is started for it.
        finished = finished_run(job, out) if args.resume else None
        try:
            if finished is not None:
                result = finished
            else:
                async with open_fleet(args, module.__name__) as executor:
                    result = await run_job(job, out, executor=executor, **run_job_options(args))
        except JobFileError as exc:  # the job file's Functions cannot be served
            return usage_error(str(exc))
        summary(result, overwrite=args.overwrite)
        if not result.interrupted and not result.already_finished:
            print_parameters(job)
        if not result.already_finished:
            print_best(job, result)
        return EXIT_INTERRUPTED if result.interrupted else 0

    code = run_command(main)
    if code == EXIT_ERROR and used_out:  # after the error line: how to go on from here
        resume_hint(used_out[0], overwrite=args.overwrite)
    return code


# -- the fleet: where ``run`` and ``eval`` send remote Functions -----------------------


def add_fleet_arguments(parser: argparse.ArgumentParser, *, sent: str) -> None:
    """``--redis URL`` or ``--workers N``, ``--worker-concurrency K`` and ``--queue NAME``:
    where a command sends the remote Functions of a job (``sent``: what, for the help).
    ``fleet_problem``, ``unserved_queue`` and ``open_fleet`` read them."""
    fleet = parser.add_mutually_exclusive_group()
    fleet.add_argument("--redis", metavar="URL", help=f"run {sent} on the workers of this Redis")
    fleet.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="the same on N local worker processes (embedded redis-server), serving the "
        "modules of the remote Functions the job file loaded",
    )
    parser.add_argument(
        "--worker-concurrency",
        type=positive_int,
        metavar="K",
        help="with --workers: tasks each worker runs at once (default 128; 1 spreads "
        "CPU-bound forwards over the workers, one per process)",
    )
    parser.add_argument("--queue", default="grads", help="the workers' queue (default: grads)")


def fleet_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the fleet flags, before anything is loaded or started; or None."""
    if args.worker_concurrency is not None and not args.workers:
        return "--worker-concurrency sizes the workers of --workers N: give --workers too"
    return redis_problem(args.redis, args.queue)


async def unserved_queue(args: argparse.Namespace) -> str | None:
    """With ``--redis``: the error to show when no worker serves the queue, else None.

    Checked before the job starts: otherwise every remote node would wait for the
    executor's timeout before saying that nobody serves the queue.
    """
    if args.redis is None:
        return None
    return await check_live_workers(args.redis, args.queue, ("MODULE",))


@contextlib.asynccontextmanager
async def open_fleet(args: argparse.Namespace, job_module: str) -> AsyncIterator[Any]:
    """The executor of the fleet the flags name, for the block: None (in-process), a
    ``RedisExecutor`` on the workers of ``--redis``, or on ``--workers N`` local workers
    started for the block, each running at most ``--worker-concurrency`` tasks at once,
    serving the modules of the remote Functions that the job file (imported as
    ``job_module``) loaded.

    Raises ``JobFileError`` when local workers cannot serve the job file's Functions
    (``worker_imports``), before any process starts.
    """
    if not args.workers:
        if args.redis is None:
            yield None
            return
        from asyncgraph.distributed import open_redis_executor

        async with open_redis_executor(args.redis, queue=args.queue) as executor:
            yield executor
        return
    import secrets

    from asyncgraph.distributed import local_fleet, open_redis_executor

    imports = worker_imports(job_module, Path(args.job_file))
    if isinstance(imports, str):
        raise JobFileError(imports)
    let_workers_import_from(Path(args.job_file).parent)
    # Signed tasks, as demo --workers: the user's secret if set (None: both sides read
    # it, and a bad one is reported by its variable's name), else a fresh one.
    secret = None if os.environ.get(SECRET_ENV, "").strip() else secrets.token_hex(32)
    sizing = {} if args.worker_concurrency is None else {"concurrency": args.worker_concurrency}
    with local_fleet(args.workers, imports, queue=args.queue, secret=secret, **sizing) as url:
        async with open_redis_executor(url, queue=args.queue, secret=secret) as executor:
            yield executor


SECRET_ENV = "ASYNCGRAPH_SECRET"  # the workers' and clients' shared secret


def worker_imports(job_module: str, job_file: Path) -> list[str] | str:
    """The modules that local workers import to serve the job: those defining the remote
    Functions loaded so far (the job file's imports), and the job file itself under its
    file name when it defines some; or why the job cannot be served.

    Workers import the job file as ``job`` for ``job.py`` (from its directory), while
    this command imported it under another name: a remote Function defined in it needs a
    ``remote_name`` to be known by one name on both sides (the message says so).
    """
    from asyncgraph import Function

    modules: dict[str, None] = {}
    stack = list(Function.__subclasses__())
    seen: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if cls.dispatch != "remote" or inspect.isabstract(cls):
            continue
        if cls.__module__ == job_module:
            if cls.__dict__.get("remote_name") is None:
                return (
                    f"the job file defines the remote Function {cls.__qualname__} without a "
                    f"remote_name: local workers import {job_file.name} as module "
                    f"{job_file.stem!r}, this command under another name; give it one "
                    f"(remote_name = '{job_file.stem}.{cls.__qualname__}'), or move it to a "
                    f"module of its own that the job file imports"
                )
            modules[job_file.stem] = None
        elif cls.__module__ != "__main__":
            modules[cls.__module__] = None
    if not modules:
        return "--workers: the job file loaded no remote Function (dispatch = 'remote') to serve"
    return sorted(modules)


def let_workers_import_from(directory: Path) -> None:
    """Put ``directory`` first on ``PYTHONPATH``, which the local workers inherit: they
    import the job file's own module (and its neighbours) from there."""
    paths = [
        str(directory.resolve()),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def add_max_attempts(parser: argparse.ArgumentParser) -> None:
    """``--max-attempts N``: retries of spec-built models (``ASYNCGRAPH_MODEL_MAX_ATTEMPTS``)."""
    parser.add_argument(
        "--max-attempts",
        type=positive_int,
        metavar="N",
        help="attempts per model call before it fails (1: no retries; default 4, or "
        "ASYNCGRAPH_MODEL_MAX_ATTEMPTS); workers started by this command inherit it",
    )


def add_logging(parser: argparse.ArgumentParser) -> None:
    """``-v`` / ``-vv`` / ``--log-level LEVEL``: see model retries, 429s, reclaims."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more on stderr: -v model retries and rate limits (INFO), -vv everything",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING (default), ERROR or CRITICAL; overrides -v",
    )


def apply_logging(args: argparse.Namespace) -> None:
    """Configure asyncgraph's loggers on stderr from ``-v`` / ``--log-level``."""
    import logging

    level = args.log_level or ("DEBUG" if args.verbose >= 2 else "INFO" if args.verbose else None)
    if level is None:
        return
    from asyncgraph._redact import RedactingFormatter

    handler = logging.StreamHandler(sys.stderr)
    # Redacted as written: a log line may quote a URL or an error's text.
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("asyncgraph")
    logger.addHandler(handler)
    logger.setLevel(level)


def apply_max_attempts(args: argparse.Namespace) -> None:
    """Put ``--max-attempts`` where spec-built models (and local workers) read it."""
    if getattr(args, "max_attempts", None) is not None:
        os.environ["ASYNCGRAPH_MODEL_MAX_ATTEMPTS"] = str(args.max_attempts)


def _in_git_repo_without_ignore(directory: Path, name: str) -> bool:
    """True when ``directory`` is in a git work tree whose top .gitignore lacks ``name``."""
    for parent in [directory, *directory.parents]:
        if (parent / ".git").exists():
            ignore = parent / ".gitignore"
            lines = ignore.read_text().splitlines() if ignore.is_file() else []
            return not any(line.strip().strip("/") == name for line in lines)
    return False


def announce_default_out(out: Path) -> None:
    """Say where a run without ``--out`` writes (and that runs/ belongs in .gitignore)."""
    note = f"run directory: {out}/ (the default; --out DIR to choose)"
    if _in_git_repo_without_ignore(Path.cwd(), DEFAULT_RUNS_DIR):
        note += f"; add '{DEFAULT_RUNS_DIR}/' to your .gitignore"
    print(note, flush=True)


def resume_hint(out: Path, *, overwrite: bool = False) -> None:
    """After a failed run: how to continue from its last checkpoint, if it left one."""
    if holds_no_step(out / CHECKPOINT_FILE):
        print(
            f"no step completed, so {out} holds nothing to resume: the same command runs "
            f"the job again from the start",
            file=sys.stderr,
            flush=True,
        )
    elif (out / CHECKPOINT_FILE).is_file():
        print(
            f"the checkpoint of the last completed step is in {out}: continue with the same "
            f"command plus --resume" + (" (instead of --overwrite)" if overwrite else ""),
            file=sys.stderr,
            flush=True,
        )


def print_parameters(job: Job, *, width: int = 400) -> None:
    """The job's parameters as they ended: what the run produced."""
    names = job.param_names or [p.role or f"parameter {i}" for i, p in enumerate(job.params)]
    print("final parameters:")
    for name, param in zip(names, job.params, strict=True):
        text = redact(str(param.data))
        if len(text) > width:
            text = text[: width - 3] + "..."
        print(f"  {name}: {text}")


def best_line(result: JobResult) -> str | None:
    """``best validation score 0.62 after step 4: runs/x/best.json``, or None without one."""
    if result.best_val_score is None or result.best_path is None:
        return None
    when = "the initial parameters" if result.best_step == 0 else f"after step {result.best_step}"
    return f"best validation score {result.best_val_score:.2f} ({when}): {result.best_path}"


def print_best(job: Job, result: JobResult, *, width: int = 400) -> None:
    """Where ``best.json`` went and the best parameters' values."""
    line = best_line(result)
    if line is None or result.best_parameters is None:
        return
    print(line)
    names = job.param_names or [p.role or f"parameter {i}" for i, p in enumerate(job.params)]
    print("best parameters:")
    for name, value in zip(names, result.best_parameters, strict=True):
        text = redact(str(value))
        if len(text) > width:
            text = text[: width - 3] + "..."
        print(f"  {name}: {text}")


def outputs(result: JobResult) -> str:
    """What the job left in its directory (metrics.png only if it was drawn)."""
    names = ["checkpoint", "history.json"]
    if result.plot_path is not None:
        names.append("metrics.png")
    return f"{', '.join(names[:-1])} and {names[-1]}"


def summary(result: JobResult, *, overwrite: bool = False) -> None:
    if result.already_finished:
        print(already_finished_line(result))
        return
    state = (
        "interrupted"
        if result.interrupted
        else "stopped early (patience: no better validation score)"
        if result.stopped_early
        else "stopped at the cost cap"
        if result.stopped_at_cost_cap
        else "finished"
    )
    where = "; forwards on the workers" if result.forward_on == "workers" else ""
    print(
        f"{state} after {result.steps_done} step(s) in {result.wall_s:.1f}s{where}; "
        f"{outputs(result)} in {result.out_dir}"
    )
    print_spending(result)
    if result.interrupted:
        print(
            "resume with the same command plus --resume"
            + (" (instead of --overwrite)" if overwrite else "")
        )
