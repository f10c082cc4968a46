"""The batch job runner: the optimization loop users otherwise write by hand.

For every step: a mini-batch from the dataset (a seeded permutation per epoch),
a concurrent forward over the batch (bounded), ``await backward`` over the
batch's losses, ``await optimizer.step()``, periodic validation, and a
checkpoint written atomically. ``resume=True`` continues exactly where an
interrupted job stopped; an interrupt (Ctrl-C) stops cleanly, leaving the
checkpoint of the last completed step.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio

from asyncgraph import Executor, Module, Parameter, Variable, backward, graph_order, no_grad
from asyncgraph.models import UsageMeter, track_usage

from ._checkpoint import (
    FORMAT,
    VERSION,
    CheckpointError,
    atomic_write_json,
    check_history,
    fingerprint_data,
    load_checkpoint,
)
from ._record import JobRecorder
from ._report import Reporter, write_history, write_plot

__all__ = ["Evaluation", "Job", "JobResult", "load_parameters", "run_job"]


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


@dataclass
class Job:
    """A prompt (or program) optimization job.

    ``forward(example)`` builds the graph for one example and returns an
    :class:`Evaluation`. ``parameters`` are what ``optimizer`` updates; their
    values are checkpointed. ``parameters`` may be a :class:`asyncgraph.Module`
    (the program whose ``forward`` the job's ``forward`` calls): its parameters,
    in ``named_parameters()`` order, are the job's, the checkpoint stores its
    ``state_dict()`` (field ``"module"``, with the parameters' names and roles
    in ``"parameters"``), and a resume loads it back with ``load_state_dict``
    (so a checkpoint from a Module with other parameters is refused by name). Tokens and cost are those of every model call
    made by the job (``asyncgraph.models.track_usage``), on workers too when
    the backward runs on a fleet. ``config`` holds the settings that
    change the job's results and are not visible to the runner (model, endpoint,
    optimizer options, ...): a JSON-able map, part of the job's identity, so a
    checkpoint is only resumed by a job configured the same way.

    Keeping the best: with a ``val_set``, the parameters with the best validation score
    so far (the initial ones included) are written to ``best.json`` in the run
    directory whenever they improve. ``keep_best=True`` also reverts a step that
    lowered the validation score: the parameters go back to the best ones (the
    optimizer's state is kept). ``patience=N`` stops the job early after N validations
    in a row without a better score. ``test_set``: held-out examples the job never
    trains or selects on; ``asyncgraph eval`` scores saved parameters on it.

    Raises ``ValueError`` for an empty ``train_set``, a non-positive size, a
    ``config`` that is not JSON, or ``keep_best`` / ``patience`` without a
    ``val_set``.
    """

    name: str
    parameters: Sequence[Parameter] | Module
    optimizer: _Optimizer
    forward: Callable[[Mapping[str, Any]], Awaitable[Evaluation]]
    train_set: Sequence[Mapping[str, Any]]
    val_set: Sequence[Mapping[str, Any]] = ()
    batch_size: int = 8
    epochs: int = 1
    max_concurrency: int = 16
    validate_every: int = 1
    seed: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    test_set: Sequence[Mapping[str, Any]] = ()
    keep_best: bool = False
    patience: int | None = None
    module: Module | None = field(init=False, default=None, repr=False)
    """The Module given as ``parameters``, else None."""
    params: list[Parameter] = field(init=False, default_factory=list, repr=False)
    """The parameters as a list (those of the Module, when one was given)."""
    param_names: list[str] = field(init=False, default_factory=list, repr=False)
    """Their dotted names in the Module (empty without one)."""

    def __post_init__(self) -> None:
        if isinstance(self.parameters, Module):
            self.module = self.parameters
            named = list(self.module.named_parameters())
            if not named:
                raise ValueError(
                    f"job {self.name!r}: its Module {type(self.module).__name__} has no "
                    f"parameters to optimize"
                )
            self.param_names = [name for name, _ in named]
            self.params = [param for _, param in named]
        else:
            self.params = list(self.parameters)
        if not self.train_set:
            raise ValueError(f"job {self.name!r} has an empty train_set")
        for name in ("batch_size", "epochs", "max_concurrency", "validate_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"job {self.name!r}: {name} must be a positive int, got {value!r}")
        self._config_json()
        if self.patience is not None and (
            not isinstance(self.patience, int)
            or isinstance(self.patience, bool)
            or self.patience < 1
        ):
            raise ValueError(
                f"job {self.name!r}: patience must be a positive int or None, got {self.patience!r}"
            )
        if (self.keep_best or self.patience is not None) and not self.val_set:
            raise ValueError(
                f"job {self.name!r}: keep_best and patience need a val_set to measure progress on"
            )

    def _config_json(self) -> dict[str, Any]:
        """``config`` as it reads back from a checkpoint (tuples become lists, ...)."""
        if not isinstance(self.config, Mapping):
            raise ValueError(f"job {self.name!r}: config must be a map, got {self.config!r:.80}")
        try:
            text = json.dumps(dict(self.config), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"job {self.name!r}: config must be JSON (str keys; str, numbers, bool, None, "
                f"lists and maps; no NaN), got {self.config!r:.120} ({exc})"
            ) from None
        loaded: dict[str, Any] = json.loads(text)
        return loaded

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_set) / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this job (JSON data)."""
        identity = {
            "name": self.name,
            "parameters": [p.role for p in self.params],
            "train_set": fingerprint_data(list(self.train_set)),
            "val_set": fingerprint_data(list(self.val_set)),
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
            "optimizer": type(self.optimizer).__name__,
            "config": self._config_json(),
        }
        if self.module is not None:
            identity["module"] = list(self.param_names)
        # Only when set: checkpoints of jobs without them keep resuming.
        if self.keep_best:
            identity["keep_best"] = True
        if self.patience is not None:
            identity["patience"] = self.patience
        return identity

    def batch(self, step: int) -> list[Mapping[str, Any]]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train_set)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
        return [self.train_set[i] for i in chosen]


@dataclass
class JobResult:
    """How a job ended: its metrics history and final parameter values.

    ``plot_path`` is where ``metrics.png`` was written, None when it was not
    (matplotlib is not installed, or drawing failed). ``already_finished`` is True
    when a resume found every step done: nothing ran and nothing was rewritten.
    """

    history: list[dict[str, Any]]
    parameters: list[Any]
    initial_val_score: float | None
    final_val_score: float | None
    steps_done: int
    interrupted: bool
    out_dir: Path
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    plot_path: Path | None = None
    already_finished: bool = False
    best_val_score: float | None = None
    """The best validation score seen (the initial one included); None without a val_set."""
    best_step: int | None = None
    """The step after which the parameters of ``best.json`` were found (0: the initial ones)."""
    best_path: Path | None = None
    """``best.json`` in the run directory, None when none was written."""
    best_parameters: list[Any] | None = None
    """The values of the best parameters, in the job's parameter order."""
    stopped_early: bool = False
    """True when ``patience`` ended the job before its last step."""


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


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def train_loss(evals: Sequence[Evaluation], train_score: float) -> float:
    """The ``train_loss`` of a step's history row.

    The mean of the batch's losses when every ``Evaluation.loss.data`` is a
    number. Text losses (a judge's feedback) have no numeric value: then it is
    ``1 - train_score``, the fraction of the batch scored wrong.
    """
    values = [e.loss.data for e in evals]
    if values and all(_is_number(v) for v in values):
        return float(sum(values)) / len(values)
    return 1.0 - train_score


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def _kind(value: Any) -> str:
    """The JSON kind of a parameter value, to check a checkpoint's values against."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "str"
    if _is_numpy(value):
        return "array"
    if _is_number(value):
        return "number"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "map"
    return "other"


def _parameter_data(param: Parameter) -> Any:
    """A parameter's value as JSON data (numpy arrays as nested lists)."""
    return param.data.tolist() if _is_numpy(param.data) else param.data


def _saved_value(param: Parameter, saved: Any) -> tuple[Any, str | None]:
    """The value to give ``param`` from its checkpointed data, or why it does not fit."""
    want, have = _kind(param.data), _kind(saved)
    if want in ("null", "other"):
        return saved, None  # nothing to check against
    if want == "array":
        import numpy

        if have not in ("list", "number"):
            return None, f"a {have}, not the numbers of an array"
        try:
            value = numpy.asarray(saved, dtype=param.data.dtype)
        except (TypeError, ValueError) as exc:
            return None, f"not an array of {param.data.dtype} ({exc})"
        if value.shape != param.data.shape:
            return None, f"an array of shape {value.shape}, not {param.data.shape}"
        return value, None
    if have != want:
        return None, f"a {have}, but the parameter holds a {want}"
    return saved, None


def _parameter_fields(job: Job) -> dict[str, Any]:
    """The checkpoint's parameter values: a list, or a Module's names and state_dict."""
    if job.module is None:
        return {"parameters": [{"role": p.role, "data": _parameter_data(p)} for p in job.params]}
    return {
        "parameters": [
            {"name": n, "role": p.role} for n, p in zip(job.param_names, job.params, strict=True)
        ],
        "module": job.module.state_dict(),
    }


def _restore(job: Job, state: Mapping[str, Any], path: Path) -> None:
    """Put a loaded checkpoint's parameters and optimizer state into ``job``.

    Everything is checked before anything is changed. Raises CheckpointError
    when the fields do not fit the job (a hand-edited or damaged file that still
    parses), rather than a bare KeyError/ValueError; the job is left as it was.
    """

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {what}; delete it to start over, or "
            f"restore a backup"
        )

    step, history, saved = state["step"], state["history"], state["parameters"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= job.total_steps:
        raise corrupt(f"step is {step!r}, not a step number in 0..{job.total_steps}")
    epoch, index = divmod(step, job.steps_per_epoch)
    if state["epoch"] != epoch or state["position"] != index * job.batch_size:
        raise corrupt(
            f"epoch {state['epoch']!r} and position {state['position']!r} do not match step "
            f"{step} (epoch {epoch}, position {index * job.batch_size})"
        )
    problem = check_history(history, step, job.steps_per_epoch)
    if problem is not None:
        raise corrupt(problem)
    initial = state.get("initial_val_score")
    if initial is not None and not _is_number(initial):
        raise corrupt(f"initial_val_score is {initial!r:.60}, not a number or null")
    if job.module is not None:
        _restore_module(job, job.module, state, corrupt)
        return
    if (
        not isinstance(saved, list)
        or len(saved) != len(job.params)
        or not all(isinstance(item, dict) and "data" in item for item in saved)
    ):
        raise corrupt(f"'parameters' is not a list of {len(job.params)} {{role, data}} maps")
    values = []
    for i, (param, item) in enumerate(zip(job.params, saved, strict=True)):
        if item.get("role") != param.role:
            raise corrupt(f"parameter {i} has role {item.get('role')!r}, not {param.role!r}")
        value, wrong = _saved_value(param, item["data"])
        if wrong is not None:
            raise corrupt(f"the value of parameter {i} ({param.role!r}) is {wrong}")
        values.append(value)
    _load_optimizer(job, state, corrupt)
    for param, value in zip(job.params, values, strict=True):
        param.data = value


def _load_optimizer(
    job: Job, state: Mapping[str, Any], corrupt: Callable[[str], CheckpointError]
) -> None:
    before = job.optimizer.state_dict()
    try:
        job.optimizer.load_state_dict(state["optimizer"])
    except Exception as exc:  # whatever the optimizer raises for data it cannot take
        with contextlib.suppress(Exception):
            job.optimizer.load_state_dict(before)  # do not leave it half-loaded
        raise corrupt(
            f"its optimizer state does not load into this job's {type(job.optimizer).__name__} "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _restore_module(
    job: Job,
    module: Module,
    state: Mapping[str, Any],
    corrupt: Callable[[str], CheckpointError],
) -> None:
    """``_restore`` for a Module job: names and roles checked, values through load_state_dict."""
    saved = state["parameters"]
    want = [{"name": n, "role": p.role} for n, p in zip(job.param_names, job.params, strict=True)]
    if saved != want:
        raise corrupt(
            f"'parameters' is {saved!r:.200}, not the {len(want)} {{name, role}} maps of "
            f"{type(module).__name__}'s parameters"
        )
    values = state.get("module")
    if not isinstance(values, dict):
        raise corrupt("field 'module' (the Module's state_dict) is missing or not a map")
    before = module.state_dict()
    try:
        module.load_state_dict(values, strict=True)
    except (KeyError, ValueError, TypeError) as exc:  # nothing changed: it checks first
        raise corrupt(f"its 'module' state does not load ({exc})") from None
    try:
        _load_optimizer(job, state, corrupt)
    except CheckpointError:
        module.load_state_dict(before)
        raise


BEST_FORMAT = "asyncgraph-best"
BEST_VERSION = 1


def _put_values(job: Job, saved: Mapping[str, Any], path: Path) -> None:
    """Put the parameter values of a checkpoint or ``best.json`` (its ``parameters`` and,
    for a Module job, ``module`` fields) into ``job``; checked first, all or nothing.
    Raises CheckpointError saying what does not fit."""

    def wrong(what: str) -> CheckpointError:
        return CheckpointError(
            f"{str(path)!r} does not hold parameters of job {job.name!r}: {what}"
        )

    if job.module is not None:
        values = saved.get("module")
        if not isinstance(values, dict):
            raise wrong("field 'module' (the Module's state_dict) is missing or not a map")
        try:
            job.module.load_state_dict(values, strict=True)
        except (KeyError, ValueError, TypeError) as exc:
            raise wrong(str(exc)) from None
        return
    items = saved.get("parameters")
    if (
        not isinstance(items, list)
        or len(items) != len(job.params)
        or not all(isinstance(item, dict) and "data" in item for item in items)
    ):
        raise wrong(f"'parameters' is not a list of {len(job.params)} {{role, data}} maps")
    new = []
    for i, (param, item) in enumerate(zip(job.params, items, strict=True)):
        if item.get("role") != param.role:
            raise wrong(f"parameter {i} has role {item.get('role')!r}, not {param.role!r}")
        value, problem = _saved_value(param, item["data"])
        if problem is not None:
            raise wrong(f"the value of parameter {i} ({param.role!r}) is {problem}")
        new.append(value)
    for param, value in zip(job.params, new, strict=True):
        param.data = value


def load_parameters(job: Job, path: str | Path) -> dict[str, Any]:
    """Load saved parameter values into ``job``: a ``best.json``, a ``checkpoint.json`` or
    a file written by ``Module.save`` (for a Module job). Returns the file's data.

    Raises CheckpointError when the file is missing, not one of these, or holds other
    parameters than the job's (nothing is changed then).
    """
    source = Path(path)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"no parameters file at {str(source)!r}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read parameters from {str(source)!r}: {exc}") from None
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == "asyncgraph-module" and job.module is not None:
        _put_values(job, {"module": data.get("state_dict")}, source)
    elif kind in (BEST_FORMAT, FORMAT):
        _put_values(job, data, source)
    else:
        raise CheckpointError(
            f"{str(source)!r} is not a best.json, a checkpoint or a saved Module (format {kind!r})"
        )
    return dict(data)


class _Best:
    """The best validation score so far and its parameters, written to ``best.json``;
    reverts (``keep_best``) and early stopping (``patience``)."""

    def __init__(self, job: Job, out: Path, saved: Mapping[str, Any] | None) -> None:
        self.job = job
        self.path = out / "best.json"
        saved = saved or {}
        record = saved.get("best")
        self.record: dict[str, Any] | None = dict(record) if isinstance(record, dict) else None
        self.since = int(saved.get("since_best", 0) or 0)
        self.stopped_early = bool(saved.get("stopped_early", False))
        self.written = False

    def observe(self, step: int, score: float | None) -> bool:
        """Take the validation score after ``step``; True if the parameters were reverted."""
        if score is None or not math.isfinite(score):
            return False
        if self.record is None or score > float(self.record["val_score"]):
            self.record = {"step": step, "val_score": score, **_parameter_fields(self.job)}
            self.since = 0
            self.write()
            return False
        self.since += 1
        if self.job.keep_best and score < float(self.record["val_score"]):
            _put_values(self.job, self.record, self.path)
            return True
        return False

    def stop(self) -> bool:
        """True once ``patience`` validations in a row brought nothing better."""
        patience = self.job.patience
        if patience is not None and self.record is not None and self.since >= patience:
            self.stopped_early = True
        return self.stopped_early

    def write(self) -> None:
        if self.record is None:
            return
        atomic_write_json(
            self.path,
            {"format": BEST_FORMAT, "version": BEST_VERSION, "job": self.job.name, **self.record},
        )
        self.written = True

    def fields(self) -> dict[str, Any]:
        """What the checkpoint keeps of it."""
        return {"best": self.record, "since_best": self.since, "stopped_early": self.stopped_early}

    def values(self) -> list[Any] | None:
        if self.record is None:
            return None
        if self.job.module is not None:
            state = self.record["module"]
            return [state[name] for name in self.job.param_names]
        return [item["data"] for item in self.record["parameters"]]


def _load(job: Job, path: Path, identity: Mapping[str, Any]) -> dict[str, Any]:
    """``load_checkpoint`` + ``_restore``: the checkpoint's state, now in ``job``."""
    try:
        state = load_checkpoint(path, identity)
        _restore(job, state, path)
    except RecursionError:  # nested JSON deep enough to exhaust the stack while checking it
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: its data is nested too deeply; delete it to "
            f"start over, or restore a backup"
        ) from None
    return state


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
    """
    out = Path(out_dir)
    ckpt_path = out / "checkpoint.json"
    started = time.perf_counter()
    identity = job.identity()
    if resume:
        if overwrite:
            raise ValueError("run_job: resume=True and overwrite=True exclude each other")
        state = _load(job, ckpt_path, identity)
        best = _Best(job, out, state)
        run = _JobRun(job, out, identity, started, executor, best, resume=True)
        run.step, run.history = state["step"], list(state["history"])
        run.initial_val = state.get("initial_val_score")
        if run.step >= job.total_steps or best.stopped_early:
            return run.result(None, already_finished=True)
    else:
        if ckpt_path.exists() and not overwrite:
            raise CheckpointError(
                f"{str(ckpt_path)!r} already holds a checkpoint: continue that job with "
                f"--resume (resume=True), start it over with --overwrite (overwrite=True), "
                f"or choose another output directory"
            )
        run = _JobRun(job, out, identity, started, executor, _Best(job, out, None), resume=False)
    run.reporter = reporter or Reporter(job.name, job.total_steps, enabled=progress)
    run.recorder = JobRecorder(
        out,
        job.params,
        names=job.param_names,
        name=job.name,
        total_steps=job.total_steps,
        trace=trace,
        log_calls=log_calls,
    )
    return await run.execute(handle_sigint)


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
        self.ckpt_path = out / "checkpoint.json"
        self.identity = identity
        self.started = started
        self.executor = executor
        self.best = best
        self.resume = resume
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.initial_val: float | None = None
        self.checkpointed = resume  # out holds this job's checkpoint (then history and plot)
        self.interrupted = False
        self.running = True
        self.stop = anyio.CancelScope()

    # -- checkpoints ---------------------------------------------------------------------
    def save(self) -> None:
        job = self.job
        epoch, position = divmod(self.step, job.steps_per_epoch)
        try:
            atomic_write_json(
                self.ckpt_path,
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "job": self.identity,
                    "step": self.step,
                    "epoch": epoch,
                    "position": position * job.batch_size,
                    **_parameter_fields(job),
                    "optimizer": job.optimizer.state_dict(),
                    "history": self.history,
                    "initial_val_score": self.initial_val,
                    **self.best.fields(),
                },
            )
            self.checkpointed = True
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the checkpoint {str(self.ckpt_path)!r}: {exc}; choose an output "
                f"directory you can write to"
            ) from exc

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        job, recorder = self.job, self.recorder
        self.reporter.start(self.step, self.history)
        recorder.start(self.step, resume=self.resume)
        if not self.resume:
            self.save()  # before the initial validation: an interrupt there leaves a checkpoint
        if job.val_set and self.initial_val is None and self.step == 0:
            recorder.phase("validation")
            with recorder.recording():
                self.initial_val = await evaluate(job, job.val_set)
            self.best.observe(0, self.initial_val)
            self.save()
        # Usage is counted from here: the initial validation's calls are not in the
        # history, whether it ran in this process or in an interrupted one.
        with track_usage() as usage, recorder.recording():
            await self.steps(usage)

    async def steps(self, usage: UsageMeter) -> None:
        job, recorder, history = self.job, self.recorder, self.history
        base_tokens = int(history[-1]["tokens"]) if history else 0
        base_cost = float(history[-1]["cost_usd"]) if history else 0.0
        base_unpriced = int(history[-1].get("unpriced_calls", 0)) if history else 0
        while self.step < job.total_steps:
            t0 = time.perf_counter()
            recorder.start_step(self.step + 1)
            job.optimizer.zero_grad()
            batch = job.batch(self.step)
            recorder.phase("forward")
            evals = await _map_bounded(job.forward, batch, job.max_concurrency)
            recorder.phase("backward")
            await backward([e.loss for e in evals], executor=self.executor)
            recorder.feedback()
            recorder.phase("optimizer step")
            await job.optimizer.step()
            job.optimizer.zero_grad()
            train_score = sum(e.score for e in evals) / len(evals)
            val_score = None
            if job.val_set and (
                (self.step + 1) % job.validate_every == 0 or self.step + 1 == job.total_steps
            ):
                recorder.phase("validation")
                val_score = await evaluate(job, job.val_set)
            spent = usage.snapshot()
            self.step += 1
            reverted = self.best.observe(self.step, val_score)
            history.append(
                {
                    "step": self.step,
                    "epoch": (self.step - 1) // job.steps_per_epoch,
                    "train_score": train_score,
                    "train_loss": train_loss(evals, train_score),
                    "val_score": val_score,
                    "tokens": base_tokens + spent.total_tokens,
                    "cost_usd": base_cost + spent.cost_usd,
                    "unpriced_calls": base_unpriced + spent.unpriced_requests,
                    "step_s": time.perf_counter() - t0,
                    **({"reverted": reverted} if job.keep_best else {}),
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

    def finish(self) -> Path | None:
        """Stop the display, roll back a half-done step, write history and plot."""
        self.reporter.stop(interrupted=self.interrupted)
        self.recorder.close()
        if not self.checkpointed:  # out could not even take the step-0 checkpoint
            return None
        if self.interrupted:
            # Parameters may hold a half-finished step: put back the saved state.
            _load(self.job, self.ckpt_path, self.identity)
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
        with receiver if receiver is not None else contextlib.nullcontext() as signals:
            async with anyio.create_task_group() as tg:
                if signals is not None:
                    tg.start_soon(self.watch_sigint, signals)
                try:
                    with self.stop:
                        await self.run()
                except Exception as exc:  # re-raised as is below, not in an ExceptionGroup
                    failure = exc
                except BaseException:  # cancelled from outside: still report the steps done
                    self.running = False
                    with contextlib.suppress(Exception):
                        self.finish()
                    raise
                self.running = False
                try:
                    plot_path = self.finish()
                except Exception as exc:
                    failure = failure or exc
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return self.result(plot_path)

    def result(self, plot_path: Path | None, *, already_finished: bool = False) -> JobResult:
        return _result(
            self.job,
            self.history,
            self.initial_val,
            self.step,
            self.interrupted,
            self.out,
            self.started,
            plot_path,
            already_finished,
            self.best,
        )


def _result(
    job: Job,
    history: list[dict[str, Any]],
    initial_val: float | None,
    step: int,
    interrupted: bool,
    out: Path,
    started: float,
    plot_path: Path | None,
    already_finished: bool,
    best: _Best,
) -> JobResult:
    final_val = next(
        (h["val_score"] for h in reversed(history) if h["val_score"] is not None), None
    )
    return JobResult(
        history=history,
        parameters=[p.data for p in job.params],
        initial_val_score=initial_val,
        final_val_score=final_val,
        steps_done=step,
        interrupted=interrupted,
        out_dir=out,
        wall_s=time.perf_counter() - started,
        plot_path=plot_path,
        already_finished=already_finished,
        best_val_score=None if best.record is None else float(best.record["val_score"]),
        best_step=None if best.record is None else int(best.record["step"]),
        best_path=best.path if best.path.is_file() else None,
        best_parameters=best.values(),
        stopped_early=best.stopped_early,
    )
