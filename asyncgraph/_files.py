"""Files that hold the user's data, readable by the user alone (mode 0600).

A leaf (it imports nothing of asyncgraph). Call logs, traces, checkpoints and the run
directory's records hold prompts, replies and parameters: the user's data, and at times
what a model echoed of a secret. They are created 0600 whatever the umask, and an
existing file written again is narrowed to 0600 too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

__all__ = ["PRIVATE_MODE", "open_private", "write_private"]

PRIVATE_MODE = 0o600


def open_private(path: str | os.PathLike[str], *, append: bool = False) -> IO[str]:
    """Open ``path`` for writing text (appending with ``append``), mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # a file that existed keeps its mode otherwise
        return os.fdopen(fd, "a" if append else "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` atomically (a temporary file, then a rename), 0600."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    with open_private(tmp) as f:
        f.write(text)
    os.replace(tmp, target)
    return target
