"""Checkpoints of a job: one JSON file, written atomically after every step."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asyncgraph import AsyncGraphError

__all__ = [
    "CheckpointError",
    "HISTORY_FIELDS",
    "atomic_write_json",
    "check_history",
    "fingerprint_data",
    "load_checkpoint",
]

FORMAT = "asyncgraph-checkpoint"
VERSION = 1


class CheckpointError(AsyncGraphError):
    """A checkpoint is missing, corrupt, or belongs to a different job."""


def fingerprint_data(value: Any) -> str:
    """A short sha256 of a JSON-able value (datasets, configurations)."""
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def atomic_write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves the old file or the new one.

    The JSON goes to a temporary file in the same directory, is flushed and
    fsynced, then renamed over ``path``; the directory is fsynced too.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(payload, indent=1, ensure_ascii=False, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    for key, want in expected.items():
        have = found.get(key)
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
    return state


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Every field of a metrics history row and the check its value must pass.
HISTORY_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "step": ("a step number", _is_count),
    "epoch": ("an epoch number", _is_count),
    "train_score": ("a number", _is_number),
    "train_loss": ("a number", _is_number),
    "val_score": ("a number or null", lambda v: v is None or _is_number(v)),
    "tokens": ("a token count", _is_count),
    "cost_usd": ("a number", _is_number),
    "step_s": ("a number", _is_number),
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
