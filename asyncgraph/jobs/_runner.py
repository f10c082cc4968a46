"""The batch job runner: the optimization loop users otherwise write by hand.

For every step: a mini-batch from the dataset (a seeded permutation per epoch),
a concurrent forward over the batch (bounded), ``await backward`` over the
batch's losses, ``await optimizer.step()``, periodic validation, and a
checkpoint written atomically. ``resume=True`` continues exactly where an
interrupted job stopped; an interrupt (Ctrl-C) stops cleanly, leaving the
checkpoint of the last completed step.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio

from .._autodiff import backward
from .._grad_mode import no_grad
from .._graph import graph_order
from .._variable import Parameter, Variable
from ..executors import Executor
from ._checkpoint import (
    FORMAT,
    VERSION,
    CheckpointError,
    atomic_write_json,
    fingerprint_data,
    load_checkpoint,
)
from ._report import Reporter, write_history, write_plot

__all__ = ["Evaluation", "Job", "JobResult", "run_job"]


@dataclass
class Evaluation:
    """What a job's forward returns for one example.

    ``loss`` is where backward starts (text feedback from a judge, or a number);
    ``score`` is the metric in [0, 1] (e.g. exact match), never differentiated.
    """

    loss: Variable
    score: float
    prediction: Any = None


class _Optimizer(Protocol):
    def zero_grad(self) -> None: ...

    def step(self) -> Awaitable[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class _HasUsage(Protocol):
    @property
    def usage(self) -> Any: ...


@dataclass
class Job:
    """A prompt (or program) optimization job.

    ``forward(example)`` builds the graph for one example and returns an
    :class:`Evaluation`. ``parameters`` are what ``optimizer`` updates; their
    values are checkpointed. ``models`` are the models whose usage (tokens,
    cost) the progress display reports.
    """

    name: str
    parameters: Sequence[Parameter]
    optimizer: _Optimizer
    forward: Callable[[Mapping[str, Any]], Awaitable[Evaluation]]
    train_set: Sequence[Mapping[str, Any]]
    val_set: Sequence[Mapping[str, Any]] = ()
    batch_size: int = 8
    epochs: int = 1
    max_concurrency: int = 16
    validate_every: int = 1
    seed: int = 0
    models: Sequence[_HasUsage] = ()

    def __post_init__(self) -> None:
        if not self.train_set:
            raise ValueError(f"job {self.name!r} has an empty train_set")
        for name in ("batch_size", "epochs", "max_concurrency", "validate_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"job {self.name!r}: {name} must be a positive int, got {value!r}")

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_set) / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this job."""
        return {
            "name": self.name,
            "parameters": [p.role for p in self.parameters],
            "train_set": fingerprint_data(list(self.train_set)),
            "val_set": fingerprint_data(list(self.val_set)),
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
        }

    def batch(self, step: int) -> list[Mapping[str, Any]]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train_set)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
        return [self.train_set[i] for i in chosen]


@dataclass
class JobResult:
    """How a job ended: its metrics history and final parameter values."""

    history: list[dict[str, Any]]
    parameters: list[Any]
    initial_val_score: float | None
    final_val_score: float | None
    steps_done: int
    interrupted: bool
    out_dir: Path
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


async def _map_bounded(
    fn: Callable[[Mapping[str, Any]], Awaitable[Evaluation]],
    items: Sequence[Mapping[str, Any]],
    limit: int,
) -> list[Evaluation]:
    results: list[Evaluation | None] = [None] * len(items)
    limiter = anyio.CapacityLimiter(limit)

    async def one(i: int) -> None:
        # The forwards run concurrently and start in any order (trio shuffles):
        # graph_order(i) makes gradients meeting in a parameter sum in batch order.
        async with limiter:
            with graph_order(i):
                result = await fn(items[i])
        if not isinstance(result, Evaluation):
            raise TypeError(
                f"a job's forward must return asyncgraph.jobs.Evaluation, got {result!r:.80}"
            )
        results[i] = result

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


async def evaluate(job: Job, examples: Sequence[Mapping[str, Any]]) -> float:
    """Mean score of ``examples`` under no_grad (no graph is recorded)."""
    if not examples:
        return float("nan")
    with no_grad():
        evals = await _map_bounded(job.forward, examples, job.max_concurrency)
    return sum(e.score for e in evals) / len(evals)


def _usage(job: Job) -> tuple[int, float]:
    tokens, cost = 0, 0.0
    for model in job.models:
        snap = model.usage.snapshot()
        tokens += int(snap.total_tokens)
        cost += float(snap.cost_usd)
    return tokens, cost


def _restore(job: Job, state: Mapping[str, Any], path: Path) -> None:
    """Put a loaded checkpoint's parameters and optimizer state into ``job``.

    Raises CheckpointError when the fields do not fit the job (a hand-edited or
    damaged file that still parses), rather than a bare KeyError/ValueError.
    """

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {what}; delete it to start over, or "
            f"restore a backup"
        )

    step, history, saved = state["step"], state["history"], state["parameters"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= job.total_steps:
        raise corrupt(f"step is {step!r}, not a step number in 0..{job.total_steps}")
    if not isinstance(history, list) or len(history) != step:
        raise corrupt(f"the metrics history does not have one row per step ({step} steps)")
    if (
        not isinstance(saved, list)
        or len(saved) != len(job.parameters)
        or not all(isinstance(item, dict) and "data" in item for item in saved)
    ):
        raise corrupt(f"'parameters' is not a list of {len(job.parameters)} {{role, data}} maps")
    try:
        job.optimizer.load_state_dict(state["optimizer"])
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise corrupt(f"its optimizer state does not load into this job's optimizer ({exc})") from exc
    for param, item in zip(job.parameters, saved, strict=True):
        param.data = item["data"]


async def run_job(
    job: Job,
    out_dir: str | Path,
    *,
    resume: bool = False,
    executor: Executor | None = None,
    progress: bool = True,
    handle_sigint: bool = False,
    reporter: Reporter | None = None,
) -> JobResult:
    """Run ``job``, checkpointing into ``out_dir`` after every step.

    ``resume=True`` loads ``out_dir/checkpoint.json`` (CheckpointError if it is
    missing, corrupt or from another job) and continues from there.
    ``handle_sigint=True`` turns SIGINT into a clean stop: the current step is
    abandoned, the checkpoint of the last completed step stays, and the result
    says ``interrupted=True``.
    """
    out = Path(out_dir)
    ckpt_path = out / "checkpoint.json"
    started = time.perf_counter()
    identity = job.identity()
    reporter = reporter or Reporter(job.name, job.total_steps, enabled=progress)

    history: list[dict[str, Any]]
    if resume:
        state = load_checkpoint(ckpt_path, identity)
        _restore(job, state, ckpt_path)
        step = state["step"]
        history = list(state["history"])
        initial_val = state.get("initial_val_score")
    else:
        step = 0
        history = []
        initial_val = await evaluate(job, job.val_set) if job.val_set else None

    def save() -> None:
        epoch, position = divmod(step, job.steps_per_epoch)
        atomic_write_json(
            ckpt_path,
            {
                "format": FORMAT,
                "version": VERSION,
                "job": identity,
                "step": step,
                "epoch": epoch,
                "position": position * job.batch_size,
                "parameters": [{"role": p.role, "data": p.data} for p in job.parameters],
                "optimizer": job.optimizer.state_dict(),
                "history": history,
                "initial_val_score": initial_val,
            },
        )

    if not resume:
        save()

    interrupted = False
    tokens_before, cost_before = _usage(job)
    base_tokens = int(history[-1]["tokens"]) if history else 0
    base_cost = float(history[-1]["cost_usd"]) if history else 0.0
    reporter.start(step, history)

    async def loop() -> None:
        nonlocal step
        while step < job.total_steps:
            t0 = time.perf_counter()
            job.optimizer.zero_grad()
            batch = job.batch(step)
            evals = await _map_bounded(job.forward, batch, job.max_concurrency)
            await backward([e.loss for e in evals], executor=executor)
            await job.optimizer.step()
            job.optimizer.zero_grad()
            train_score = sum(e.score for e in evals) / len(evals)
            val_score = None
            if job.val_set and ((step + 1) % job.validate_every == 0 or step + 1 == job.total_steps):
                val_score = await evaluate(job, job.val_set)
            tokens, cost = _usage(job)
            step += 1
            history.append(
                {
                    "step": step,
                    "epoch": (step - 1) // job.steps_per_epoch,
                    "train_score": train_score,
                    "train_loss": 1.0 - train_score,
                    "val_score": val_score,
                    "tokens": base_tokens + tokens - tokens_before,
                    "cost_usd": base_cost + cost - cost_before,
                    "step_s": time.perf_counter() - t0,
                }
            )
            # No await between the history row and the checkpoint: an interrupt cannot
            # split them (an interrupt before this point redoes the step on resume).
            save()
            reporter.update(step, history[-1])

    failure: Exception | None = None
    try:
        if handle_sigint:
            async with anyio.create_task_group() as tg:

                async def watch_sigint() -> None:
                    nonlocal interrupted
                    with anyio.open_signal_receiver(signal.SIGINT) as signals:
                        async for _ in signals:
                            interrupted = True
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch_sigint)
                try:
                    await loop()
                except Exception as exc:  # re-raised as is below, not in an ExceptionGroup
                    failure = exc
                tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
        else:
            await loop()
    finally:
        reporter.stop()

    if interrupted:
        # Parameters may hold a half-finished step: put back the saved state.
        _restore(job, load_checkpoint(ckpt_path, identity), ckpt_path)
    write_history(out / "history.json", history)
    write_plot(out / "metrics.png", history, job.name, initial_val)
    final_val = next((h["val_score"] for h in reversed(history) if h["val_score"] is not None), None)
    return JobResult(
        history=history,
        parameters=[p.data for p in job.parameters],
        initial_val_score=initial_val,
        final_val_score=final_val,
        steps_done=step,
        interrupted=interrupted,
        out_dir=out,
        wall_s=time.perf_counter() - started,
    )
