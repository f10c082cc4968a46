"""Every file asyncgraph writes: redacted, and readable by the user alone. One home.

A leaf (it imports only ``asyncgraph._redact``, another leaf). Checkpoints, ``best.json``,
``history.json``, ``steps.jsonl``, ``metrics.png``, call logs, traces, saved Modules,
cache entries and worker metrics hold prompts, replies and parameters: the user's data,
and at times what a model echoed of a secret. So every one of them is written here:

- its text goes through the one redaction (``asyncgraph._redact``, NOTE [Redaction]);
  JSON data string by string (:func:`write_private_json`, :class:`PrivateLines`), so a
  mask never breaks an escape; bytes (a picture) are written as they are, and what they
  show is redacted before they are drawn;
- files are created 0600 and directories 0700, whatever the umask; a file that existed is
  replaced (or, appended to, narrowed) to 0600; a directory that existed keeps its mode
  (it may be the user's working directory);
- a whole file is replaced atomically (a temporary file in the same directory, fsynced,
  renamed, the directory fsynced): a crash leaves the old file or the new one.

Two more doors, each for one case: :func:`write_credentials` writes a file that must
hold a secret for the program that reads it (redis-server's ``requirepass``), private
and not redacted; :func:`private_umask` is for a third-party library that writes files
of its own (MLflow's store): while it runs, new files and directories get 0600 / 0700.
``tests/test_files.py`` fails when a module of asyncgraph writes a file another way.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Self

from asyncgraph._redact import redact, redact_data

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_MODE",
    "PrivateLines",
    "append_private_line",
    "json_records",
    "json_text",
    "private_dir",
    "private_umask",
    "write_credentials",
    "write_private",
    "write_private_json",
]

PRIVATE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_umask_lock = threading.Lock()


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create directory ``path`` and its missing parents, each one 0700 (those that exist
    keep their mode); returns it as a ``Path``."""
    target = Path(path)
    missing: list[Path] = []
    here = target
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(PRIVATE_DIR_MODE)
        except FileExistsError:  # made meanwhile by another writer
            continue
        os.chmod(directory, PRIVATE_DIR_MODE)  # the umask may have taken bits off
    return target


def json_text(
    value: Any,
    *,
    indent: int | None = None,
    sort_keys: bool = False,
    allow_nan: bool = True,
    repr_unknown: bool = True,
) -> str:
    """``value`` as JSON text with every string redacted (``redact_data``). A value JSON
    does not know is written as its redacted ``repr`` (``repr_unknown=False``: raises
    ``TypeError``). Raises ``ValueError`` for NaN or infinity when ``allow_nan`` is False."""
    return json.dumps(
        redact_data(value),
        ensure_ascii=False,
        indent=indent,
        sort_keys=sort_keys,
        allow_nan=allow_nan,
        default=(lambda unknown: redact(repr(unknown))) if repr_unknown else None,
    )


def write_private(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Replace ``path`` with ``data``, atomically, mode 0600, its directory made private
    (``private_dir``) if missing. Text is redacted; bytes are written as they are.

    Example::

        write_private("runs/x/notes.txt", f"asked {base_url}")   # the URL's password masked
    """
    if isinstance(data, str):
        data = redact(data).encode("utf-8")
    return _replace(Path(path), data)


def write_private_json(
    path: str | os.PathLike[str],
    value: Any,
    *,
    indent: int | None = None,
    sort_keys: bool = False,
    allow_nan: bool = True,
    repr_unknown: bool = True,
) -> Path:
    """``write_private`` of ``value`` as JSON, every string in it redacted (``json_text``)."""
    text = json_text(
        value, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan, repr_unknown=repr_unknown
    )
    return _replace(Path(path), text.encode("utf-8"))


def write_credentials(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` as ``write_private`` does, but NOT redacted: only for
    a file whose reader needs the secret in it (a server's configuration), never for an
    output."""
    return _replace(Path(path), text.encode("utf-8"))


def _replace(target: Path, data: bytes) -> Path:
    private_dir(target.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, PRIVATE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    except OSError:  # a file system that cannot sync a directory: the file itself is
        pass
    finally:
        os.close(dir_fd)
    return target


class PrivateLines:
    """A file of lines, mode 0600, each line redacted as it is written and flushed at
    once (a reader sees it live). ``append=False`` starts the file over. Thread-safe.

    Example::

        with PrivateLines("runs/x/calls.jsonl") as lines:
            lines.write_json({"reply": reply})
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self.path = Path(path)
        private_dir(self.path.parent)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        fd = os.open(self.path, flags, PRIVATE_MODE)
        try:
            os.fchmod(fd, PRIVATE_MODE)  # a file that existed keeps its mode otherwise
            self._file: IO[str] | None = os.fdopen(fd, "a" if append else "w", encoding="utf-8")
        except BaseException:
            os.close(fd)
            raise
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        """Write ``line`` (redacted; no newline in it) and a newline."""
        self._put(redact(line))

    def write_json(self, value: Any, *, allow_nan: bool = True) -> None:
        """Write ``value`` as one line of JSON, every string in it redacted."""
        self._put(json_text(value, allow_nan=allow_nan))

    def _put(self, line: str) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"{str(self.path)!r} is closed")
            self._file.write(line + "\n")
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def json_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines text (what ``PrivateLines`` writes); a line cut
    short (a file being written) or holding anything else is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def append_private_line(
    path: str | os.PathLike[str], value: Any, *, allow_nan: bool = True
) -> None:
    """Append ``value`` as one line of JSON (every string redacted) to ``path``, 0600."""
    with PrivateLines(path) as lines:
        lines.write_json(value, allow_nan=allow_nan)


@contextmanager
def private_umask() -> Iterator[None]:
    """Run the block with the umask narrowed to 077, so the files and directories that a
    third-party library creates in it (MLflow's store) are 0600 / 0700.

    The umask belongs to the process: another thread creating a file meanwhile gets the
    private mode too (never a wider one). Blocks are serialized, so each restores what
    it found.
    """
    with _umask_lock:
        before = os.umask(0o077)
        os.umask(before | 0o077)
        try:
            yield
        finally:
            os.umask(before)
