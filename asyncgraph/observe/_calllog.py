"""A log of model calls: one JSON line per call, as it happens.

Each line holds the request as sent (messages and parameters; headers never), the
reply, tokens, latency, whether it was cached, the attempts it took (and the error each
retried one met), its cost (null when the model has no price), the node it ran in, the
trace (``trace_pass``) and the labels (``labels``: a job's step and phase) it belongs
to, and the process. Secrets
never reach the file: requests carry no headers, and every line is written through the
one private write (``asyncgraph._files.PrivateLines``), which redacts each of its
strings (NOTE [Redaction] in ``asyncgraph._redact``: URL credentials, the environment's
and the registered secrets in the forms servers echo them, ``Bearer`` and ``sk-...``
keys). The file is created 0600: its prompts and replies are the user's data.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Self

from asyncgraph._files import PrivateLines, json_records

from ..models import ModelCall, observe_calls
from ._context import PROCESS, current_labels, node_info
from ._timeline import current_timeline

__all__ = ["CallLog", "call_record", "log_calls", "read_call_log"]


def call_record(call: ModelCall) -> dict[str, Any]:
    """The JSON-ready line of ``call``, with its node, trace and labels from this context.

    Example::

        with observe_calls(lambda call: print(call_record(call)["latency_s"])):
            await model.complete([{"role": "user", "content": "Hi"}])
    """
    timeline = current_timeline()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(call.started_at))
        + f".{int(call.started_at * 1000) % 1000:03d}Z",
        "started_at": call.started_at,
        "model": call.model,
        "endpoint": call.endpoint,
        "request": call.request,
        "reply": call.reply,
        "finish_reason": call.finish_reason,
        "error": call.error,
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": call.completion_tokens,
        "cost_usd": call.cost_usd,
        "latency_s": round(call.latency_s, 6),
        "cached": call.cached,
        "attempts": call.attempts,
        "retries": call.retries,
        "retried_after": list(call.retried_after),
        "node": node_info(),
        "trace_id": None if timeline is None else timeline.trace_id,
        "labels": dict(current_labels()),
        "process": PROCESS,
    }


class CallLog:
    """Appends one JSON line per model call to ``path`` (see the module docstring).

    ``with call_log.recording():`` logs the calls made in the block (this task and the
    tasks it starts); ``close()`` closes the file. Lines are written and flushed as
    calls finish, so a reader (``asyncgraph ui``) sees them live. Thread-safe.

    Example::

        call_log = CallLog("calls.jsonl")
        with call_log.recording():
            await loss.backward()
        call_log.close()
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self.path = Path(path)
        self._lines = PrivateLines(self.path, append=append)
        self._lock = threading.Lock()
        self.count = 0

    def on_call(self, call: ModelCall) -> None:
        """A model call observer: write ``call``'s line."""
        self.write(call_record(call))

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record (``call_record``'s, perhaps with more labels) as a line."""
        with self._lock:
            if self._lines.closed:  # a call that ended after close(): not logged
                return
            self._lines.write_json(record)
            self.count += 1

    @contextmanager
    def recording(self) -> Iterator[Self]:
        with observe_calls(self.on_call):
            yield self

    def close(self) -> None:
        with self._lock:
            self._lines.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class log_calls:  # a context manager used like a function, as open() is
    """Log every model call made in the block to ``path``, one JSON line each.

    ``with log_calls("calls.jsonl"):`` or ``async with``; appends (``append=False``
    starts the file over). Yields the ``CallLog`` (``.count`` calls written). See the
    module docstring for the fields and for how secrets are kept out::

        with log_calls("calls.jsonl"):
            await loss.backward()
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = True) -> None:
        self.path = path
        self.append = append
        self._stack: ExitStack | None = None

    def __enter__(self) -> CallLog:
        if self._stack is not None:
            raise RuntimeError("this log_calls is already open; create one per block")
        stack = ExitStack()
        log = stack.enter_context(CallLog(self.path, append=self.append))
        stack.enter_context(log.recording())
        self._stack = stack
        return log

    def __exit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    async def __aenter__(self) -> CallLog:
        return self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        self.__exit__(*exc_info)


def read_call_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a call log; a line cut short (a file being written) is skipped.

    Example::

        with log_calls("calls.jsonl"):
            await loss.backward()
        for record in read_call_log("calls.jsonl"):
            print(record["model"], record["latency_s"], record["cost_usd"])
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return json_records(text)
