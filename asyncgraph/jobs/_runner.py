"""The run loop of a job: the optimization loop users otherwise write by hand.

For every step: a mini-batch from the dataset (``Job.batch``), a concurrent forward
over the batch (bounded), ``await backward`` over the batch's losses, ``await
optimizer.step()``, periodic validation, the best parameters so far (``best.json``,
``keep_best`` reverts, ``patience``), and a checkpoint. ``resume=True`` continues
exactly where an interrupted job stopped; an interrupt (Ctrl-C) stops cleanly, leaving
the checkpoint of the last completed step. What a checkpoint holds, and every check of
it on a resume, is ``_checkpoint``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import signal
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncgraph import Executor, backward, graph_order, no_grad, remote_forwards
from asyncgraph.models import track_usage
from asyncgraph.optim import NoFeedbackWarning
from asyncgraph.text import StructuredOutputError

from ._checkpoint import (
    CHECKPOINT_FILE,
    CheckpointError,
    Progress,
    holds_no_step,
    is_number,
    not_the_parameters_of,
    parameter_fields,
    put_values,
    restore_checkpoint,
    saved_values,
    write_best,
    write_checkpoint,
)
from ._job import Evaluation, Job, JobResult
from ._reachable import check_model_specs
from ._record import JobRecorder
from ._report import Reporter, write_history, write_plot
from ._spending import Spending, check_priced

__all__ = ["evaluate", "run_job", "train_loss"]


async def _map_bounded(
    fn: Callable[[Mapping[str, Any]], Awaitable[Evaluation]],
    items: Sequence[Mapping[str, Any]],
    limit: int,
    *,
    strict: bool = True,
    skipped: list[dict[str, Any]] | None = None,
) -> list[Evaluation | None]:
    """Every item's Evaluation, in order; with ``strict=False`` an item whose forward raised
    ``StructuredOutputError`` is None, and noted in ``skipped``."""
    results: list[Evaluation | None] = [None] * len(items)
    limiter = anyio.CapacityLimiter(limit)

    async def one(i: int) -> None:
        # The forwards run concurrently and start in any order (trio shuffles):
        # graph_order(i) makes gradients meeting in a parameter sum in batch order.
        async with limiter:
            with graph_order(i):
                try:
                    result = await fn(items[i])
                except StructuredOutputError as exc:
                    if strict:
                        raise
                    if skipped is not None:
                        skipped.append(
                            {"example": i, "attempts": exc.attempts, "reply": exc.reply[:300]}
                        )
                    return
        if not isinstance(result, Evaluation):
            raise TypeError(
                f"a job's forward must return asyncgraph.jobs.Evaluation, got {result!r:.80}"
            )
        results[i] = result

    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(one, i)
    if skipped is not None:
        skipped.sort(key=lambda s: int(s["example"]))
    return results


async def evaluate(job: Job, examples: Sequence[Mapping[str, Any]]) -> float:
    """Mean score of ``examples`` under no_grad (no graph is recorded). An example whose
    reply never fit its ``response_format`` scores 0 (unless ``job.strict``).

    Example::

        score = await evaluate(job, job.val_set)      # the mean of the examples' scores
    """
    return (await _evaluate(job, examples))[0]


async def _evaluate(
    job: Job, examples: Sequence[Mapping[str, Any]]
) -> tuple[float, list[dict[str, Any]]]:
    """``evaluate``'s score and the examples it skipped."""
    if not examples:
        return float("nan"), []
    skipped: list[dict[str, Any]] = []
    with no_grad():
        evals = await _map_bounded(
            job.forward, examples, job.max_concurrency, strict=job.strict, skipped=skipped
        )
    return sum(e.score for e in evals if e is not None) / len(evals), skipped


def train_loss(evals: Sequence[Evaluation], train_score: float) -> float:
    """The ``train_loss`` of a step's history row.

    The mean of the batch's losses when every ``Evaluation.loss.data`` is a
    number. Text losses (a judge's feedback) have no numeric value: then it is
    ``1 - train_score``, the fraction of the batch scored wrong.
    """
    values = [e.loss.data for e in evals]
    if values and all(is_number(v) for v in values):
        return float(sum(values)) / len(values)
    return 1.0 - train_score


async def run_job(
    job: Job,
    out_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    executor: Executor | None = None,
    progress: bool = True,
    handle_sigint: bool = False,
    reporter: Reporter | None = None,
    trace: bool = False,
    log_calls: str | Path | None = None,
) -> JobResult:
    """Run ``job``, checkpointing into ``out_dir`` after every step.

    The step-0 checkpoint is written before the initial validation (with
    ``initial_val_score`` None until it is known), then one after every step;
    ``history.json`` and ``metrics.png`` are written when the job ends, also
    when it fails or is interrupted (for the steps completed).

    ``executor`` runs the backwards (None: in-process); with
    ``job.forward_on_workers`` and an executor that runs forwards (a RedisExecutor),
    the forwards of remote Functions too, in training and validation
    (``JobResult.forward_on`` says where they ran).

    With ``job.max_cost_usd`` set, a model the job can be seen to reach without a price
    raises ``ModelConfigError`` before anything runs or is written (see
    ``asyncgraph.jobs._spending``).

    ``resume=True`` loads ``out_dir/checkpoint.json`` (CheckpointError if it is
    missing, corrupt or from another job) and continues from there, running the
    initial validation first if it is still missing. Without it an existing
    checkpoint raises CheckpointError unless ``overwrite=True`` (then the job
    starts over). ``handle_sigint=True`` turns SIGINT into a clean stop, from
    the start of the run (initial validation included): the current step is
    abandoned, the checkpoint of the last completed step stays, and the result
    says ``interrupted=True``; more SIGINTs while it stops are ignored.

    For ``asyncgraph ui``, ``out_dir/steps.jsonl`` gets each step's parameter values
    and feedback; ``trace=True`` writes a Chrome / Perfetto timeline per step
    (``traces/step-NNNN.json``), ``log_calls=PATH`` appends every model call to that
    JSON-lines file, labelled with its step and phase (see ``asyncgraph.jobs._record``).

    Example::

        result = await run_job(job, "runs/arith", handle_sigint=True)
        result = await run_job(job, "runs/arith", resume=True)   # after a stop: go on
    """
    out = Path(out_dir)
    ckpt_path = out / CHECKPOINT_FILE
    started = time.perf_counter()
    identity = job.identity()
    # A model name that names no model fails here, before any call or file.
    check_model_specs(job.optimizer, job.parameters, job.forward)
    if resume:
        if overwrite:
            raise ValueError("run_job: resume=True and overwrite=True exclude each other")
        run = _resumed(job, out, identity, started, executor)
        if run.finished:
            return run.result(None, already_finished=True)
    else:
        # A checkpoint of this job that completed no step holds nothing to resume: replaced.
        if ckpt_path.exists() and not overwrite and not holds_no_step(ckpt_path, identity):
            raise CheckpointError(
                f"{str(ckpt_path)!r} already holds a checkpoint: continue that job with "
                f"resume=True, start it over with overwrite=True, or choose another "
                f"output directory"
            )
        run = _JobRun(job, out, identity, started, executor, _Best(job, out, None), resume=False)
    if job.max_cost_usd is not None:  # before any call, and before anything is written
        check_priced(job.name, job.max_cost_usd, job.optimizer, job.parameters, job.forward)
    run.reporter = reporter or Reporter(job.name, job.total_steps, enabled=progress)
    run.recorder = JobRecorder(
        out,
        job.params,
        names=job.param_names,
        name=job.name,
        total_steps=job.total_steps,
        trace=trace,
        log_calls=log_calls,
        forward_on=run.forward_on,
        max_cost_usd=job.max_cost_usd,
    )
    return await run.execute(handle_sigint)


def finished_run(job: Job, out_dir: str | Path) -> JobResult | None:
    """What ``run_job(job, out_dir, resume=True)`` would return at once, without running
    anything, when the run in ``out_dir`` has nothing left to do (all its steps done, or
    stopped early); None when a resume would run steps. Raises ``CheckpointError`` as a
    resume would. The CLIs ask before starting a fleet for nothing."""
    out = Path(out_dir)
    run = _resumed(job, out, job.identity(), time.perf_counter(), None)
    return run.result(None, already_finished=True) if run.finished else None


def _resumed(
    job: Job, out: Path, identity: dict[str, Any], started: float, executor: Executor | None
) -> _JobRun:
    """The run of ``out``'s checkpoint, restored into ``job`` (``CheckpointError`` if it
    is missing, corrupt or from another job)."""
    saved = restore_checkpoint(job, out / CHECKPOINT_FILE, identity)
    best = _Best(job, out, saved)
    run = _JobRun(job, out, identity, started, executor, best, resume=True)
    run.step, run.history, run.initial_val = saved.step, saved.history, saved.initial_val_score
    run.initial_usage, run.spent_before = saved.initial_usage, saved.spent
    run.resumed_at = len(saved.history)
    return run


@contextlib.contextmanager
def _quiet_about_feedback(optimizer: Any, strict: bool = False) -> Iterator[None]:
    """Silence the optimizer's per-step ``NoFeedbackWarning`` (``warn_unfed`` replaces it)
    and ``ReplySkippedWarning`` (the history records skipped updates); a strict job makes
    an optimizer with a ``strict`` switch strict."""
    saved = {
        name: getattr(optimizer, name)
        for name in ("warn_no_feedback", "warn_skipped", "strict")
        if hasattr(optimizer, name)
    }
    for name in saved:
        setattr(optimizer, name, strict if name == "strict" else False)
    if not strict and "strict" in saved:
        optimizer.strict = saved["strict"]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(optimizer, name, value)


class _JobRun:
    """One run of a job: the loop, its checkpoints, Ctrl-C, and the records at the end.

    ``step``, ``history`` and ``initial_val`` are the job's progress; the checkpoint is
    written from them after every step (``save``).
    """

    reporter: Reporter
    recorder: JobRecorder

    def __init__(
        self,
        job: Job,
        out: Path,
        identity: dict[str, Any],
        started: float,
        executor: Executor | None,
        best: _Best,
        *,
        resume: bool,
    ) -> None:
        self.job = job
        self.out = out
        self.ckpt_path = out / CHECKPOINT_FILE
        self.identity = identity
        self.started = started
        self.executor = executor
        self.best = best
        self.resume = resume
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.initial_val: float | None = None
        self.initial_usage: dict[str, Any] | None = None
        self.spent_before: dict[str, Any] | None = None  # the checkpoint's ``spent``
        self.skipped_examples = 0  # in the initial validation (the steps' are in history)
        self.fed: set[int] = set()  # ids of the parameters that got feedback in a step
        self.resumed_at: int | None = None
        self.spending: Spending | None = None
        self.checkpointed = resume  # out holds this job's checkpoint (then history and plot)
        self.interrupted = False
        self.running = True
        self.stop = anyio.CancelScope()
        self.forwards = forwards_executor(job, executor)

    # -- checkpoints ---------------------------------------------------------------------
    def save(self) -> None:
        progress = Progress(
            self.step,
            self.history,
            self.initial_val,
            **self.best.fields(),
            initial_usage=self.initial_usage,
            spent=self.spent(),
        )
        write_checkpoint(self.ckpt_path, self.job, self.identity, progress)
        self.checkpointed = True

    def spent(self) -> dict[str, Any] | None:
        """The running totals of every call of the job so far, cut steps' included."""
        if self.spending is not None:
            return self.spending.totals()
        return self.spent_before or (self.history[-1] if self.history else self.initial_usage)

    @property
    def finished(self) -> bool:
        """Nothing left to do: every step done, or stopped early (patience, the cost cap)."""
        return self.step >= self.job.total_steps or self.best.stopped_early

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        recorder = self.recorder
        if self.job.forward_on_workers and self.forwards is None:
            print(
                f"note: {self.job.name}: forward_on_workers is ignored: the job runs without "
                f"an executor that runs forwards (a RedisExecutor), so its forwards run here",
                file=sys.stderr,
                flush=True,
            )
        self.reporter.start(self.step, self.history)
        recorder.start(self.step, resume=self.resume)
        if not self.resume:
            self.save()  # before the initial validation: an interrupt there leaves a checkpoint
        await self.validate_first()
        with recorder.recording():
            await self.steps()

    async def validate_first(self) -> None:
        """The initial validation (step 0), unless done; its spend starts the totals."""
        job, spending = self.job, self.spending
        assert spending is not None
        if job.val_set and self.initial_val is None and self.step == 0:
            self.recorder.phase("validation")
            with self.recorder.recording(), remote_forwards(self.forwards):
                self.initial_val, skipped = await _evaluate(job, job.val_set)
            self.skipped_examples += len(skipped)
            self.initial_usage = spending.totals()
            self.best.observe(0, self.initial_val)
            self.save()

    async def steps(self) -> None:
        job, recorder, history, spending = self.job, self.recorder, self.history, self.spending
        assert spending is not None
        start_cost = float((self.initial_usage or {}).get("cost_usd", 0.0))
        while self.step < job.total_steps:
            validating = bool(job.val_set) and (
                (self.step + 1) % job.validate_every == 0 or self.step + 1 == job.total_steps
            )
            if not spending.next_step_fits(history, start_cost, validating):
                break
            t0 = time.perf_counter()
            recorder.start_step(self.step + 1)
            job.optimizer.zero_grad()
            batch = job.batch(self.step)
            unread: list[dict[str, Any]] = []  # examples whose reply never parsed
            recorder.phase("forward")
            with remote_forwards(self.forwards):
                results = await _map_bounded(
                    job.forward, batch, job.max_concurrency, strict=job.strict, skipped=unread
                )
            evals = [e for e in results if e is not None]
            unread = [{**u, "phase": "training"} for u in unread]
            recorder.phase("backward")
            if evals:  # every example's verdict unreadable: nothing to learn from
                await backward([e.loss for e in evals], executor=self.executor)
            self.fed.update(id(p) for p in job.params if p.grad is not None)
            recorder.feedback()
            recorder.phase("optimizer step")
            await job.optimizer.step()
            job.optimizer.zero_grad()
            skipped_updates = [s.to_data() for s in getattr(job.optimizer, "skipped", ())]
            train_score = sum(e.score for e in evals) / len(results)  # a skipped one: 0
            val_score = None
            if validating:
                recorder.phase("validation")
                with remote_forwards(self.forwards):
                    val_score, unread_val = await _evaluate(job, job.val_set)
                unread += [{**u, "phase": "validation"} for u in unread_val]
            self.step += 1
            reverted = self.best.observe(self.step, val_score)
            history.append(
                {
                    "step": self.step,
                    "epoch": (self.step - 1) // job.steps_per_epoch,
                    "train_score": train_score,
                    "train_loss": train_loss(evals, train_score) if evals else 1.0,
                    "val_score": val_score,
                    **spending.totals(),
                    "step_s": time.perf_counter() - t0,
                    **({"reverted": reverted} if job.keep_best else {}),
                    **({"skipped_updates": skipped_updates} if skipped_updates else {}),
                    **({"skipped_examples": unread} if unread else {}),
                }
            )
            # No await between the history row and the checkpoint: an interrupt cannot
            # split them (an interrupt before this point redoes the step on resume).
            recorder.end_step(history[-1])
            early = self.best.stop()
            self.save()
            self.reporter.update(self.step, history[-1])
            if early:
                break

    # -- stopping ------------------------------------------------------------------------
    async def watch_sigint(self, signals: Any) -> None:
        async for _ in signals:
            if self.running and not self.interrupted:
                self.interrupted = True
                self.stop.cancel()
            elif self.running:
                print(
                    f"{self.job.name}: already stopping after Ctrl-C", file=sys.stderr, flush=True
                )

    def finish(self, *, failed: bool = False) -> Path | None:
        """Stop the display, roll back a half-done step, write history and plot; say in
        steps.jsonl why a run that did not fail stopped before its last step."""
        self.reporter.stop(interrupted=self.interrupted)
        reason = None if failed else self.stop_reason
        if reason is not None and self.step < self.job.total_steps:
            self.recorder.stop(reason, self.step)
        self.recorder.close()
        if not self.checkpointed:  # out could not even take the step-0 checkpoint
            return None
        if self.interrupted or self.capped or failed:
            # Parameters may hold a half-finished step: put back the saved state, and keep
            # what that step's calls cost (they were paid, a failed step's too) for the
            # resume to count on from.
            restore_checkpoint(self.job, self.ckpt_path, self.identity)
            self.save()
        try:
            write_history(self.out / "history.json", self.history)
            drawn = write_plot(
                self.out / "metrics.png", self.history, self.job.name, self.initial_val
            )
        except Exception as exc:  # do not hide the job's own outcome behind a reporting error
            print(
                f"note: could not write {self.out}/history.json or metrics.png: {exc}",
                file=sys.stderr,
            )
            return None
        return self.out / "metrics.png" if drawn else None

    async def execute(self, handle_sigint: bool) -> JobResult:
        """Run to the end, a failure or Ctrl-C; write the records either way."""
        failure: Exception | None = None
        plot_path: Path | None = None
        receiver = anyio.open_signal_receiver(signal.SIGINT) if handle_sigint else None
        # Running totals over every call of the job (see _spending): on a resume, from
        # what the checkpoint says was spent (cut steps included).
        before = self.spent() or {}
        with (
            receiver if receiver is not None else contextlib.nullcontext() as signals,
        ):
            self.spending = Spending(self.job.max_cost_usd, before, self.stop)
            async with anyio.create_task_group() as tg:
                if signals is not None:
                    tg.start_soon(self.watch_sigint, signals)
                tg.start_soon(self.spending.watch)
                try:
                    with (
                        self.stop,
                        _quiet_about_feedback(self.job.optimizer, self.job.strict),
                        track_usage(self.spending.meter),
                    ):
                        await self.run()
                except Exception as exc:  # re-raised as is below, not in an ExceptionGroup
                    failure = exc
                except BaseException as exc:  # cancelled from outside: still report the steps done
                    self.running = False
                    with contextlib.suppress(Exception):
                        self.finish(failed=True)
                        self.reporter.end(self.out, exc)
                    raise
                self.running = False
                try:
                    failed = failure is not None or self.spending.error is not None
                    plot_path = self.finish(failed=failed)
                except Exception as exc:
                    failure = failure or exc
                tg.cancel_scope.cancel()
        if failure is None and self.spending is not None and self.spending.error is not None:
            failure = self.spending.error
        self.reporter.end(self.out, failure)
        if failure is not None:
            raise failure
        self.warn_unfed()
        return self.result(plot_path)

    def warn_unfed(self) -> None:
        """A ``NoFeedbackWarning`` per parameter that got feedback in none of the steps run.

        A step in which every example was right leaves the parameters without feedback,
        and that is no fault: the optimizer's own warning is silenced during the run, and
        only a parameter that never got any (unused, or cut off by ``no_grad``) is named.
        """
        ran = len(self.history) - (self.resumed_at or 0)
        if self.interrupted or ran <= 0:
            return
        names = self.job.param_names or [str(i) for i in range(len(self.job.params))]
        for name, param in zip(names, self.job.params, strict=True):
            if param.requires_grad and id(param) not in self.fed:
                role = f" ({param.role!r})" if param.role else ""
                warnings.warn(
                    NoFeedbackWarning(
                        f"{self.job.name}: parameter {name}{role} "
                        f"received no feedback in any of the {ran} step(s) run, so the "
                        f"optimizer never changed it. If it should have: check that the "
                        f"job's forward uses it, with requires_grad=True and outside "
                        f"no_grad(), in computing the loss it returns"
                    ),
                    stacklevel=4,
                )

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped (``_record.STOP_REASONS``), or None."""
        if self.capped:
            return "cost_cap"
        if self.interrupted:
            return "interrupted"
        if self.best.stopped_early:
            return "patience"
        return None

    @property
    def capped(self) -> bool:
        """True when the cost cap stopped the run (before a step, or cutting one). Not when
        the call that passed it was the last of the job and no await followed it to take
        the stop (on trio): the job finished, with that step's checkpoint."""
        return (
            self.spending is not None and self.spending.capped and self.step < self.job.total_steps
        )

    def result(self, plot_path: Path | None, *, already_finished: bool = False) -> JobResult:
        history, best, spent = self.history, self.best, self.spent() or {}
        ran = history[self.resumed_at or 0 :]
        final_val = next(
            (h["val_score"] for h in reversed(history) if h["val_score"] is not None), None
        )
        return JobResult(
            history=history,
            parameters=[p.data for p in self.job.params],
            initial_val_score=self.initial_val,
            final_val_score=final_val,
            steps_done=self.step,
            interrupted=self.interrupted,
            out_dir=self.out,
            wall_s=time.perf_counter() - self.started,
            plot_path=plot_path,
            already_finished=already_finished,
            best_val_score=None if best.record is None else float(best.record["val_score"]),
            best_step=None if best.record is None else int(best.record["step"]),
            best_path=best.path if best.path.is_file() else None,
            best_parameters=None if best.record is None else saved_values(self.job, best.record),
            stopped_early=best.stopped_early,
            stopped_at_cost_cap=self.capped,
            cost_usd=float(spent.get("cost_usd", 0.0)),
            replayed_calls=int(spent.get("replayed_calls", 0)),
            skipped_updates=sum(len(h.get("skipped_updates", ())) for h in ran),
            skipped_examples=self.skipped_examples
            + sum(len(h.get("skipped_examples", ())) for h in ran),
            cut_calls=int(spent.get("cut_calls", 0)),
            max_cost_usd=self.job.max_cost_usd,
            forward_on=self.forward_on,
        )

    @property
    def forward_on(self) -> str:
        """Where the forwards of remote Functions run: ``"workers"`` or ``"in-process"``."""
        return "in-process" if self.forwards is None else "workers"


def forwards_executor(job: Job, executor: Executor | None) -> Any:
    """The executor for ``remote_forwards`` in a run of ``job`` with ``executor``: that
    executor when ``job.forward_on_workers`` is set and it can run a forward elsewhere (a
    ``RedisExecutor``), else None (the forwards run here)."""
    apply = getattr(executor, "apply", None)
    runs_forwards = inspect.iscoroutinefunction(apply)
    return executor if job.forward_on_workers and runs_forwards else None


class _Best:
    """The best validation score so far and its parameters, written to ``best.json``;
    reverts (``keep_best``) and early stopping (``patience``)."""

    def __init__(self, job: Job, out: Path, saved: Progress | None) -> None:
        self.job = job
        self.path = out / "best.json"
        saved = saved or Progress()
        self.record: dict[str, Any] | None = None if saved.best is None else dict(saved.best)
        self.since = saved.since_best
        self.stopped_early = saved.stopped_early

    def observe(self, step: int, score: float | None) -> bool:
        """Take the validation score after ``step``; True if the parameters were reverted."""
        if score is None or not math.isfinite(score):
            return False
        if self.record is None or score > float(self.record["val_score"]):
            self.record = {"step": step, "val_score": score, **parameter_fields(self.job)}
            self.since = 0
            write_best(self.path, self.job, self.record)
            return False
        self.since += 1
        if self.job.keep_best and score < float(self.record["val_score"]):
            put_values(self.job, self.record, not_the_parameters_of(self.job, self.path))
            return True
        return False

    def stop(self) -> bool:
        """True once ``patience`` validations in a row brought nothing better."""
        patience = self.job.patience
        if patience is not None and self.record is not None and self.since >= patience:
            self.stopped_early = True
        return self.stopped_early

    def fields(self) -> dict[str, Any]:
        """What the checkpoint keeps of it: the fields of ``Progress`` it owns."""
        return {"best": self.record, "since_best": self.since, "stopped_early": self.stopped_early}
