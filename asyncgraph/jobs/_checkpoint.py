"""The checkpoint of a job, all of it: what it holds, writing it, and resuming from it.

A run directory holds two files of parameters, both JSON, both written atomically
(``atomic_write_json``: a crash leaves the old file or the new one):

- ``checkpoint.json``, rewritten after every step: the job's identity (what a resume
  must match, ``Job.identity()``), its :class:`Progress` (step, metrics history, the
  best validation so far), the parameter values and the optimizer's state.
- ``best.json``: the parameters with the best validation score so far.

A resume reads in this order, all of it here: ``restore_checkpoint`` reads the file and
checks that it is a checkpoint of this job (``load_checkpoint``), checks every field
against the job (``_restore``: the progress, the history's rows, the best record, the
parameter values), then puts the values and the optimizer state in, all or nothing
(the optimizer's ``load_state_dict`` is its own check: if it refuses, the values go back).
``load_parameters`` puts the values of either file (or of a ``Module.save`` file) into
a job. Every file that cannot be used raises :class:`CheckpointError`, saying what is
wrong and what to do.

How a parameter value is stored: as JSON data (a numpy array as nested lists), in a
list of ``{role, data}`` maps; for a job whose parameters are a Module, the names and
roles in that list and the values in the Module's ``state_dict()`` (field ``module``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgraph._exceptions import CheckpointError
from asyncgraph._files import write_private_json
from asyncgraph._redact import redact_data
from asyncgraph._values import from_json, to_json

if TYPE_CHECKING:  # the job spec builds its identity with fingerprint_data from here
    from ._job import Job

__all__ = [
    "holds_no_step",
    "BEST_FORMAT",
    "CheckpointError",
    "HISTORY_FIELDS",
    "Progress",
    "atomic_write_json",
    "check_history",
    "fingerprint_data",
    "is_number",
    "load_checkpoint",
    "load_parameters",
    "not_the_parameters_of",
    "parameter_fields",
    "put_values",
    "restore_checkpoint",
    "saved_values",
    "write_best",
    "write_checkpoint",
]

CHECKPOINT_FILE = "checkpoint.json"
FORMAT = "asyncgraph-checkpoint"
USAGE_TOTALS = ("tokens", "cost_usd", "unpriced_calls")  # running totals of a history row
# ... and those a checkpoint of an older version may lack: model calls a rerun of a
# remote task replayed from its journal instead of paying for them again, and model calls
# cut before their answer, counted at an upper bound (the cost is then one).
OPTIONAL_TOTALS = ("replayed_calls", "cut_calls")
VERSION = 1
BEST_FORMAT = "asyncgraph-best"
BEST_VERSION = 1
MODULE_FORMAT = "asyncgraph-module"  # a file written by Module.save


@dataclass
class Progress:
    """How far a job got: what a checkpoint keeps besides parameters and optimizer.

    ``best`` is the best validation so far, ``{"step", "val_score", **parameter_fields}``
    (None before the first validation, or without a ``val_set``); ``since_best`` counts
    the validations since it, ``stopped_early`` says ``patience`` ended the job.
    """

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    initial_val_score: float | None = None
    best: dict[str, Any] | None = None
    since_best: int = 0
    stopped_early: bool = False
    initial_usage: dict[str, Any] | None = None
    """What the initial validation spent (``tokens``, ``cost_usd``, ``unpriced_calls``):
    the history's running totals start from it, so they add up to the call log."""
    spent: dict[str, Any] | None = None
    """The running totals of every model call of the job so far, those of a step that was
    cut (Ctrl-C, the cost cap) or failed and rolled back included: paid all the same, so a
    resume counts on from here, not from the last step's row. None in older checkpoints."""


# -- files -------------------------------------------------------------------------------


def fingerprint_data(value: Any) -> str:
    """A short sha256 of a JSON-able value (datasets, configurations)."""
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def atomic_write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves the old file or the new one.

    Through the one private write (``asyncgraph._files``): every string redacted, mode
    0600 (prompts, replies and parameters are the user's data), a new directory 0700, a
    temporary file fsynced and renamed over ``path``, the directory fsynced too.
    """
    write_private_json(path, payload, indent=1, sort_keys=True, repr_unknown=False)


# -- parameter values as JSON ------------------------------------------------------------


def is_number(value: Any) -> bool:
    """A real number, not a bool (numpy scalars count)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parameter_fields(job: Job) -> dict[str, Any]:
    """The job's parameter values as a checkpoint or ``best.json`` stores them: the
    field ``parameters`` (``{role, data}`` maps), or for a Module job ``parameters``
    (``{name, role}`` maps) and ``module`` (its ``state_dict()``)."""
    if job.module is None:
        return {"parameters": [{"role": p.role, "data": to_json(p.data)} for p in job.params]}
    return {
        "parameters": [
            {"name": n, "role": p.role} for n, p in zip(job.param_names, job.params, strict=True)
        ],
        "module": job.module.state_dict(),
    }


def saved_values(job: Job, fields: Mapping[str, Any]) -> list[Any]:
    """The values in ``parameter_fields(job)`` (as JSON data), in the job's order."""
    if job.module is not None:
        state = fields["module"]
        return [state[name] for name in job.param_names]
    return [item["data"] for item in fields["parameters"]]


def put_values(job: Job, saved: Mapping[str, Any], wrong: Callable[[str], CheckpointError]) -> None:
    """Put the parameter values of ``saved`` (its ``parameter_fields``) into ``job``.

    Checked first, all or nothing: raises ``wrong(what does not fit)`` and changes
    nothing when a value does not fit its parameter. A Module job's values go through
    ``load_state_dict`` (which checks every name and value before it changes one).
    """
    if job.module is not None:
        values = saved.get("module")
        if not isinstance(values, dict):
            raise wrong("field 'module' (the Module's state_dict) is missing or not a map")
        try:
            job.module.load_state_dict(values, strict=True)
        except (KeyError, ValueError, TypeError) as exc:
            raise wrong(f"its 'module' state does not load ({exc})") from None
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
        try:
            new.append(from_json(param.data, item["data"]))
        except ValueError as exc:
            raise wrong(f"the value of parameter {i} ({param.role!r}) is {exc}") from None
    for param, value in zip(job.params, new, strict=True):
        param.data = value


def not_the_parameters_of(job: Job, path: Path) -> Callable[[str], CheckpointError]:
    """The ``wrong`` of ``put_values`` for a file of parameters (``best.json``, ...)."""

    def wrong(what: str) -> CheckpointError:
        return CheckpointError(
            f"{str(path)!r} does not hold parameters of job {job.name!r}: {what}"
        )

    return wrong


def _put_back(job: Job, values: list[Any]) -> None:
    """Undo ``put_values``: ``values`` are the parameters' ``data`` from before."""
    for param, value in zip(job.params, values, strict=True):
        param.data = value


# -- writing -----------------------------------------------------------------------------


def write_checkpoint(path: Path, job: Job, identity: Mapping[str, Any], progress: Progress) -> None:
    """Write ``job``'s checkpoint: its identity, progress, parameters and optimizer state.

    Raises CheckpointError when ``path`` cannot be written.
    """
    epoch, position = divmod(progress.step, job.steps_per_epoch)
    try:
        atomic_write_json(
            path,
            {
                "format": FORMAT,
                "version": VERSION,
                "job": identity,
                "step": progress.step,
                "epoch": epoch,
                "position": position * job.batch_size,
                **parameter_fields(job),
                "optimizer": job.optimizer.state_dict(),
                "history": progress.history,
                "initial_val_score": progress.initial_val_score,
                "best": progress.best,
                "since_best": progress.since_best,
                "stopped_early": progress.stopped_early,
                "initial_usage": progress.initial_usage,
                "spent": progress.spent,
            },
        )
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the checkpoint {str(path)!r}: {exc}; choose an output "
            f"directory you can write to"
        ) from exc


def write_best(path: Path, job: Job, best: Mapping[str, Any]) -> None:
    """Write ``best.json``: ``best`` is ``Progress.best``."""
    atomic_write_json(
        path, {"format": BEST_FORMAT, "version": BEST_VERSION, "job": job.name, **best}
    )


# -- resuming ----------------------------------------------------------------------------


def restore_checkpoint(job: Job, path: Path, identity: Mapping[str, Any]) -> Progress:
    """Resume from ``path``: read it, check all of it, put its parameters and optimizer
    state into ``job``, and return the job's progress. Nothing of ``job`` changes when
    it raises CheckpointError (a missing, corrupt or foreign checkpoint)."""
    try:
        return _restore(job, load_checkpoint(path, identity), path)
    except RecursionError:  # nested JSON deep enough to exhaust the stack while checking it
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: its data is nested too deeply; delete it to "
            f"start over, or restore a backup"
        ) from None


def holds_no_step(path: Path, expected: Mapping[str, Any] | None = None) -> bool:
    """Whether ``path`` is a checkpoint that completed no step (a run that failed or was
    stopped before its first step ended), of the job ``expected`` describes when given:
    a rerun of that job replaces it, since there is nothing in it to resume."""
    try:
        if expected is None:
            state = json.loads(path.read_bytes())
        else:
            state = load_checkpoint(path, expected)
    except (OSError, ValueError, CheckpointError):
        return False
    return isinstance(state, dict) and state.get("step") == 0 and not state.get("history")


def load_checkpoint(path: Path, expected: Mapping[str, Any]) -> dict[str, Any]:
    """Read a checkpoint and check it belongs to the job described by ``expected``.

    Raises CheckpointError saying what is wrong and what to do.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"no checkpoint at {str(path)!r} to resume from; run without --resume to start fresh"
        ) from None
    try:
        state = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt (not valid JSON: {exc}); delete it to "
            f"start over, or restore a backup"
        ) from exc
    except RecursionError:  # valid JSON nested deeper than Python's parser recurses
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt (its JSON is nested too deeply to be a "
            f"checkpoint); delete it to start over, or restore a backup"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not an asyncgraph checkpoint (missing format marker); "
            f"point --out at the job's own directory"
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has version {state.get('version')!r}, this asyncgraph "
            f"reads version {VERSION}"
        )
    for key in ("job", "step", "epoch", "position", "parameters", "optimizer", "history"):
        if key not in state:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: field {key!r} is missing")
    found = state.get("job")
    if not isinstance(found, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: field 'job' is not a map")
    _check_identity(path, found, expected)
    return state


def _check_identity(path: Path, found: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming what differs when the checkpoint's ``job`` (``found``)
    is not the job of ``expected`` (its ``Job.identity()``)."""
    for key, want in expected.items():
        have = found.get(key)
        if key == "config":  # as Job.identity() shows it: a checkpoint written before
            have = redact_data(have, by_name=True)  # configs were redacted resumes too
        if have != want:
            what = f"{key} is {have!r} there but {want!r} now"
            if isinstance(have, dict) and isinstance(want, dict):
                # A configuration map: name the settings that differ, not the whole map.
                what = "; ".join(
                    f"{key}[{sub!r}] is {have.get(sub)!r} there but {want.get(sub)!r} now"
                    for sub in sorted({*have, *want}, key=str)
                    if have.get(sub) != want.get(sub)
                )
            raise CheckpointError(
                f"checkpoint {str(path)!r} belongs to a different job: {what}. Resume with "
                f"the same job settings, or use another output directory (or delete the "
                f"checkpoint) to start fresh"
            )


# Every field of a metrics history row and the check its value must pass.
HISTORY_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "step": ("a step number", _is_count),
    "epoch": ("an epoch number", _is_count),
    "train_score": ("a number", is_number),
    "train_loss": ("a number", is_number),
    "val_score": ("a number or null", lambda v: v is None or is_number(v)),
    "tokens": ("a token count", _is_count),
    "cost_usd": ("a number", is_number),
    "step_s": ("a number", is_number),
}


def check_history(history: Any, steps: int, steps_per_epoch: int) -> str | None:
    """What is wrong with a checkpoint's metrics history, or None if it is sound.

    A sound history is a list of ``steps`` rows, row ``i`` a map holding every
    field of ``HISTORY_FIELDS`` with a value of the right type, ``step == i + 1``
    and the epoch of that step.
    """
    if not isinstance(history, list) or len(history) != steps:
        return f"the metrics history does not have one row per step ({steps} steps)"
    for i, row in enumerate(history):
        if not isinstance(row, dict):
            return f"history row {i} is {row!r:.60}, not a map"
        for name, (kind, ok) in HISTORY_FIELDS.items():
            if name not in row:
                return f"history row {i} has no field {name!r}"
            if not ok(row[name]):
                return f"history row {i} field {name!r} is {row[name]!r:.60}, not {kind}"
        if row["step"] != i + 1 or row["epoch"] != i // steps_per_epoch:
            return (
                f"history row {i} is for step {row['step']!r} of epoch {row['epoch']!r}, "
                f"expected step {i + 1} of epoch {i // steps_per_epoch}"
            )
    return None


def _check_best(state: Mapping[str, Any], step: int) -> str | None:
    """What is wrong with a checkpoint's ``best``, ``since_best`` and ``stopped_early``,
    or None. Each may be missing or null (checkpoints written before they existed)."""
    best = state.get("best")
    if best is not None and not (
        isinstance(best, dict)
        and _is_count(best.get("step"))
        and best["step"] <= step
        and is_number(best.get("val_score"))
    ):
        return (
            f"'best' is {best!r:.80}, not null or a map of a step up to {step}, a val_score "
            f"and parameters"
        )
    since = state.get("since_best")
    if since is not None and not _is_count(since):
        return f"since_best is {since!r:.60}, not a count of validations"
    stopped = state.get("stopped_early")
    if stopped is not None and not isinstance(stopped, bool):
        return f"stopped_early is {stopped!r:.60}, not true or false"
    return None


def _restore(job: Job, state: Mapping[str, Any], path: Path) -> Progress:
    """Put a loaded checkpoint's parameters and optimizer state into ``job``.

    Raises CheckpointError when the fields do not fit the job (a hand-edited or
    damaged file that still parses), rather than a bare KeyError/ValueError; the job
    is left as it was then. Returns the checkpoint's progress.
    """

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: {what}; delete it to start over, or "
            f"restore a backup"
        )

    step, history = state["step"], state["history"]
    if not _is_count(step) or step > job.total_steps:
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
    if initial is not None and not is_number(initial):
        raise corrupt(f"initial_val_score is {initial!r:.60}, not a number or null")
    problem = _check_best(state, step)
    if problem is not None:
        raise corrupt(problem)
    usage = {key: _usage(state, key, corrupt) for key in ("initial_usage", "spent")}
    if job.module is not None:
        want = [
            {"name": n, "role": p.role} for n, p in zip(job.param_names, job.params, strict=True)
        ]
        if state["parameters"] != want:
            raise corrupt(
                f"'parameters' is {state['parameters']!r:.200}, not the {len(want)} "
                f"{{name, role}} maps of {type(job.module).__name__}'s parameters"
            )
    before = [param.data for param in job.params]
    best = state.get("best")
    if best is not None:  # a keep_best revert puts these values in: check they fit now
        put_values(job, best, lambda what: corrupt(f"the parameters of 'best': {what}"))
        _put_back(job, before)
    put_values(job, state, corrupt)
    try:
        _load_optimizer(job, state, corrupt)
    except CheckpointError:
        _put_back(job, before)
        raise
    return Progress(
        step=step,
        history=list(history),
        initial_val_score=initial,
        best=best,
        since_best=state.get("since_best") or 0,
        stopped_early=bool(state.get("stopped_early")),
        initial_usage=usage["initial_usage"],
        spent=usage["spent"],
    )


def _usage(
    state: Mapping[str, Any], key: str, corrupt: Callable[[str], CheckpointError]
) -> dict[str, Any] | None:
    """The usage totals at ``key`` (absent in checkpoints of older versions: None)."""
    totals = state.get(key)
    if totals is not None and not (
        isinstance(totals, dict)
        and set(USAGE_TOTALS) <= set(totals) <= {*USAGE_TOTALS, *OPTIONAL_TOTALS}
        and all(is_number(value) and value >= 0 for value in totals.values())
    ):
        raise corrupt(f"{key} is {totals!r:.100}, not a map of {USAGE_TOTALS}")
    return totals


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


def load_parameters(job: Job, path: str | Path) -> dict[str, Any]:
    """Load saved parameter values into ``job``: a ``best.json``, a ``checkpoint.json`` or
    a file written by ``Module.save`` (for a Module job). Returns the file's data.

    Raises CheckpointError when the file is missing, not one of these, or holds other
    parameters than the job's (nothing is changed then).

    Example::

        load_parameters(job, "runs/arith/best.json")
        print(await evaluate(job, job.test_set))    # a Job given a test_set
    """
    source = Path(path)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"no parameters file at {str(source)!r}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read parameters from {str(source)!r}: {exc}") from None
    except RecursionError:
        raise CheckpointError(
            f"cannot read parameters from {str(source)!r}: JSON nested too deeply"
        ) from None
    wrong = not_the_parameters_of(job, source)
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == BEST_FORMAT:  # what `asyncgraph eval` prints of it must be what it says
        score, step = data.get("val_score"), data.get("step")
        if not (score is None or is_number(score)) or not (step is None or _is_count(step)):
            raise CheckpointError(
                f"{str(source)!r} is corrupt: its step {step!r:.40} and val_score "
                f"{score!r:.40} must be a step number and a number (or null)"
            )
    if kind == MODULE_FORMAT and job.module is not None:
        put_values(job, {"module": data.get("state_dict")}, wrong)
    elif kind in (BEST_FORMAT, FORMAT):
        put_values(job, data, wrong)
    else:
        raise CheckpointError(
            f"{str(source)!r} is not a best.json, a checkpoint or a saved Module (format {kind!r})"
        )
    return dict(data)
