"""What ``asyncgraph run`` and ``asyncgraph demo`` share: argument types, the check that
a Redis queue has live workers, and turning errors into one ``error: ...`` line.

Exit codes: 0 done, 1 an asyncgraph error (model, Redis, backward, ...), 2 a usage
error or a checkpoint that cannot be used, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import anyio

from asyncgraph import AsyncGraphError
from asyncgraph._redact import redact

from ._checkpoint import CHECKPOINT_FILE, CheckpointError, holds_no_step
from ._job import Job, JobResult

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "add_observe_arguments",
    "check_live_workers",
    "non_negative_float",
    "non_negative_int",
    "positive_int",
    "redis_problem",
    "run_command",
    "usage_error",
]

# The errors reported as one line: asyncgraph's (model and Redis errors included).
_REPORTED = AsyncGraphError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
"""argparse type: an int >= 1."""
non_negative_int = _int_at_least(0)
"""argparse type: an int >= 0."""


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _call_log_path(text: str) -> str:
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; give a file to append to, e.g. {text.rstrip('/')}/calls.jsonl"
        )
    return text


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be a number > 0, got 0")
    return value


def add_cost_cap_argument(parser: argparse.ArgumentParser) -> None:
    """``--max-cost USD``, shared by ``run`` and ``demo`` (``Job.max_cost_usd``)."""
    parser.add_argument(
        "--max-cost",
        type=positive_float,
        metavar="USD",
        help="stop at the step boundary before the spend would pass USD dollars, or cut "
        "a step that passes it (the last whole step's checkpoint stays); every model "
        "needs a price. --resume --max-cost HIGHER goes on",
    )


def add_start_arguments(parser: argparse.ArgumentParser) -> None:
    """``--resume`` / ``--overwrite`` (one or neither), shared by ``run`` and ``demo``."""
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start over even if --out holds a checkpoint (it is replaced)",
    )


def run_job_options(args: argparse.Namespace) -> dict[str, Any]:
    """``run_job``'s options as ``run`` and ``demo`` take them from the command line
    (``add_start_arguments``, ``--no-progress``, ``add_observe_arguments``): the same
    whether the job runs here or on a fleet."""
    return {
        "resume": args.resume,
        "overwrite": getattr(args, "overwrite", False),
        "progress": not args.no_progress,
        "handle_sigint": True,
        "trace": getattr(args, "trace", False),
        "log_calls": getattr(args, "log_calls", None),
    }


def spending_line(result: JobResult) -> str | None:
    """What a job spent (against its cap, if it has one; "at most" when calls were cut
    before their answer), and the calls a crash did not bill twice; None when there is no
    cap, no priced call and no replayed call."""
    replayed, cut = result.replayed_calls, result.cut_calls
    spent = f"{'at most ' if cut else ''}${result.cost_usd:.4f}"
    parts = []
    if result.max_cost_usd is not None:
        parts.append(f"spent {spent} of the ${result.max_cost_usd:g} cap")
    elif result.cost_usd > 0:
        parts.append(f"spent {spent} on model calls")
    if cut:
        parts.append(
            f"an upper bound: {cut} model call(s) were cut before their answer came back, "
            f"each counted at its prompt plus its max_tokens of answer"
        )
    if replayed:
        parts.append(
            f"{replayed} model call(s) replayed from their task's journal after a worker "
            f"crashed (not paid again)"
        )
    return "; ".join(parts) or None


def print_spending(result: JobResult) -> None:
    """Print ``spending_line`` and ``cost_line`` of ``result``, those it has."""
    for line in (spending_line(result), cost_line(result)):
        if line is not None:
            print(line)


def cost_line(result: JobResult) -> str | None:
    """What a capped run spent, and how to go on; None when the cap did not stop it."""
    if not result.stopped_at_cost_cap or result.max_cost_usd is None:
        return None
    return (
        f"stopped at the cost cap: {'at most ' if result.cut_calls else ''}"
        f"${result.cost_usd:.4f} spent of ${result.max_cost_usd:g}; "
        f"continue with the same command plus --resume and a higher --max-cost"
    )


def add_observe_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace`` and ``--log-calls PATH``, shared by ``run`` and ``demo``."""
    parser.add_argument(
        "--trace",
        action="store_true",
        help="write a timeline of each step to OUT/traces/step-NNNN.json "
        "(Chrome/Perfetto trace JSON: open it at https://ui.perfetto.dev)",
    )
    parser.add_argument(
        "--log-calls",
        metavar="PATH",
        type=_call_log_path,
        help="append every model call (request, reply, tokens, latency, cached, retries, "
        "node, step) to PATH as JSON lines; API keys are never written",
    )


def usage_error(message: str) -> int:
    """Print ``error: message`` (redacted) on stderr; the exit code of a usage error."""
    print(f"error: {redact(message)}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def existing_run_problem(
    out: Path, *, resume: bool, overwrite: bool, job: Job | None = None
) -> str | None:
    """What is wrong with starting a run in ``out`` that holds an earlier run's checkpoint
    without ``--resume`` or ``--overwrite``, in the command line's words; or None. A
    checkpoint of ``job`` that completed no step is no problem: the run replaces it."""
    if resume or overwrite or not (out / CHECKPOINT_FILE).exists():
        return None
    if job is not None and holds_no_step(out / CHECKPOINT_FILE, job.identity()):
        return None
    return (
        f"{str(out / CHECKPOINT_FILE)!r} holds the checkpoint of an earlier run: continue it "
        f"with --resume, start it over with --overwrite, or choose another --out"
    )


def already_finished_line(result: JobResult) -> str:
    """What ``run --resume`` and ``demo --resume`` say of a run that has nothing left to do."""
    return (
        f"already finished ({result.steps_done} step(s)); nothing to do. Its results are in "
        f"{result.out_dir}; --overwrite starts it over"
    )


def redis_problem(url: str | None, queue: str) -> str | None:
    """What is wrong with ``--redis URL`` / ``--queue NAME`` before connecting, or None."""
    try:
        # The fleet's modules load when a command uses them, not for --help.
        from asyncgraph.distributed import check_queue_name
        from asyncgraph.resp import parse_redis_url

        check_queue_name(queue)
        if url is not None:
            parse_redis_url(url)
    except ValueError as exc:
        return str(exc)
    return None


async def check_live_workers(url: str, queue: str, imports: Sequence[str]) -> str | None:
    """None if ``queue`` at ``url`` has a live worker, else the error to show.

    Without it a job would wait for the executor's timeout on every node before
    saying nobody serves the queue. Raises ``RemoteConnectionError`` when Redis
    does not answer (within 5 s).
    """
    from asyncgraph.distributed import live_workers

    if await live_workers(url, queue, timeout_s=5.0):
        return None
    return no_live_workers_message(queue, imports)


def no_live_workers_message(queue: str, imports: Sequence[str] = ("MODULE",)) -> str:
    """The executor's "no worker alive" diagnosis, with the command that starts one."""
    modules = " ".join(f"--import {m}" for m in imports)
    return (
        f"no worker of queue {queue!r} is alive: start one with `asyncgraph worker "
        f"--redis URL --queue {queue} {modules}` (or drop --redis to run in-process)"
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _report(errors: Sequence[BaseException]) -> int:
    """Print one ``error:`` line per distinct error (redacted: an error may quote a URL or
    a reply that quoted a key); the exit code for them."""
    seen: set[str] = set()
    for error in errors:
        text = redact(
            str(error) if isinstance(error, _REPORTED) else f"{type(error).__name__}: {error}"
        )
        if text not in seen:
            seen.add(text)
            print(f"error: {text}", file=sys.stderr, flush=True)
    if all(isinstance(e, CheckpointError) for e in errors):
        return EXIT_USAGE
    return EXIT_ERROR


def _report_first(errors: Sequence[BaseException]) -> int:
    """One ``error:`` line for a group of errors: the first, where it was raised (the
    innermost frame), and how many more; exit code 1."""
    first = errors[0]
    where = ""
    frames = traceback.extract_tb(first.__traceback__)
    ours = Path(__file__).resolve().parents[1]
    theirs = [f for f in frames if ours not in Path(f.filename).resolve().parents]
    if frames:  # the innermost frame of the user's code (the job file), else of ours
        last = (theirs or frames)[-1]
        where = f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    more = len(errors) - 1
    others = f"; and {more} more error{'s' if more > 1 else ''} in the same step" if more else ""
    text = redact(f"{type(first).__name__}: {first}")
    print(f"error: {text}{where}{others}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def _interrupted() -> int:
    print("interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_command(main: Callable[[], Awaitable[int]]) -> int:
    """``anyio.run(main)``, with asyncgraph's errors and Ctrl-C as one line, not a traceback.

    ``AsyncGraphError`` (and subclasses: CheckpointError exits 2, the others 1),
    ``KeyboardInterrupt`` (130) and any exception group (what a step's concurrent
    forward or backward raises: one line naming its first error, where it was raised,
    and how many more there were; exit 1) are reported this way; a lone exception of
    another kind (a bug, in asyncgraph or in a job file) keeps its traceback.

    Ctrl-C outside ``run_job`` (which turns it into a clean stop) raises
    KeyboardInterrupt where the program is, even in blocking code such as a
    fleet's start: asyncio's runner would otherwise only cancel the main task,
    which blocking code does not notice, and which a task group can absorb.
    """
    install = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _keyboard_interrupt) if install else None
    try:
        return anyio.run(main)
    except KeyboardInterrupt:
        return _interrupted()
    except _REPORTED as exc:
        return _report([exc])
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
            return _interrupted()
        if not any(isinstance(leaf, _REPORTED) for leaf in leaves):
            return _report_first(leaves)
        return _report(leaves)
    finally:
        if install:
            signal.signal(signal.SIGINT, previous)
