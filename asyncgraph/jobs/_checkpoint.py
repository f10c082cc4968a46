"""Checkpoints of a job: one JSON file, written atomically after every step."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._exceptions import AsyncGraphError

__all__ = ["CheckpointError", "atomic_write_json", "load_checkpoint", "fingerprint_data"]

FORMAT = "asyncgraph-checkpoint"
VERSION = 1


class CheckpointError(AsyncGraphError):
    """A checkpoint is missing, corrupt, or belongs to a different job."""


def fingerprint_data(value: Any) -> str:
    """A short sha256 of a JSON-able value (datasets, configurations)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
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
            raise CheckpointError(
                f"checkpoint {str(path)!r} belongs to a different job: {key} is {have!r} "
                f"there but {want!r} now. Resume with the same job settings, or use another "
                f"output directory (or delete the checkpoint) to start fresh"
            )
    return state
