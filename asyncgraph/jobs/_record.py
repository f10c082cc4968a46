"""What a job leaves for ``asyncgraph ui`` besides its checkpoint: one line per step.

``steps.jsonl`` in the run directory gets a line when the job starts (step 0: the
initial parameter values) and after every step, written before that step's checkpoint:
the step, the wall time, where the forwards of remote Functions ran (``forward_on``:
``"workers"`` or ``"in-process"``), the run's cost cap (``max_cost_usd``, None without
one), each parameter's value and the feedback it received in the
step (its ``.grad`` before the optimizer used it; named by its role and, in a job over
a Module, its dotted name), the step's trace file (with
``trace=True``: ``traces/step-NNNN.json``, a Chrome / Perfetto timeline of the whole
step, its phases on the first row) and the call log (with ``log_calls=PATH``: every
model call, labelled with its step and phase). A step that was redone after an
interrupt has two lines: the last one holds.

Two kinds of line say what happened to the run between steps; they have an ``event``
and no ``step`` (readers of step lines skip them), with the steps done (``at_step``),
the wall time, ``forward_on`` and ``max_cost_usd``:

- ``"event": "resume"``: a resumed run starts (its cap and executor may differ from the
  run before it);
- ``"event": "stop"``: a run stopped before its last step, ``reason`` ``"cost_cap"``
  (``Job.max_cost_usd``), ``"interrupted"`` (Ctrl-C) or ``"patience"``; a run that
  fails writes none, nor one that ends at its last step.

Recording never fails a job: a file that cannot be written is reported once on stderr
and left out.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from asyncgraph import Parameter, observe_nodes
from asyncgraph._files import append_private_line

from ..models import ModelCall, observe_calls
from ..observe import CallLog, Span, Timeline, call_record

__all__ = ["STEPS_FILE", "STOP_REASONS", "TRACES_DIR", "JobRecorder", "json_value", "trace_name"]

STEPS_FILE = "steps.jsonl"
STOP_REASONS = ("cost_cap", "interrupted", "patience")
"""The ``reason`` of a ``stop`` line: why a run ended before its last step."""
TRACES_DIR = "traces"
_MAX_TEXT = 20_000  # characters of one value or feedback kept in steps.jsonl


def trace_name(step: int) -> str:
    """The trace file of ``step``, relative to the run directory."""
    return f"{TRACES_DIR}/step-{step:04d}.json"


def json_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON data for steps.jsonl: numpy as lists, long text cut, others repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= _MAX_TEXT else value[:_MAX_TEXT] + " …[cut]"
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return json_value(value.tolist(), depth)
    if depth < 8 and isinstance(value, (list, tuple)):
        return [json_value(v, depth + 1) for v in value[:1000]]
    if depth < 8 and isinstance(value, Mapping):
        return {str(k): json_value(v, depth + 1) for k, v in list(value.items())[:1000]}
    return json_value(repr(value), depth)


class JobRecorder:
    """Writes ``steps.jsonl``, the step traces and the call log of one run of a job.

    The runner calls ``start`` once, then per step ``start_step``, ``phase`` before each
    phase, ``feedback`` after the backward and ``end_step`` once the step's metrics
    row exists; ``recording()`` is open around the steps, ``close()`` at the end (also
    after a failure: the unfinished step's trace is written, its nodes marked).
    """

    def __init__(
        self,
        out: Path,
        parameters: Sequence[Parameter],
        *,
        names: Sequence[str] = (),
        name: str,
        total_steps: int | None = None,
        trace: bool = False,
        log_calls: str | Path | None = None,
        forward_on: str = "in-process",
        max_cost_usd: float | None = None,
    ) -> None:
        self.out = out
        self.forward_on = forward_on
        self.max_cost_usd = max_cost_usd
        self.parameters = list(parameters)
        self.names = list(names) if names else [""] * len(self.parameters)
        self.name = name
        self.total_steps = total_steps
        self.trace = trace
        self.call_log_path = None if log_calls is None else Path(log_calls).resolve()
        self.call_log: CallLog | None = None
        self.step = 0
        self.phase_name = ""
        self.timeline: Timeline | None = None
        self._phase_span: Span | None = None
        self._feedback: list[Any] = [None] * len(self.parameters)
        self._calls = 0
        self._broken: set[str] = set()

    # -- the runner's calls ---------------------------------------------------------
    def start(self, step: int, *, resume: bool) -> None:
        """The run begins at ``step``; a fresh run records the initial values (step 0)."""
        self.step = step
        if self.call_log_path is not None and self.call_log is None:
            try:
                self.call_log = CallLog(self.call_log_path)
            except OSError as exc:
                self._note("call log", exc)
        if not resume:
            first = {
                "step": 0,
                "time": time.time(),
                "total_steps": self.total_steps,
                **self._run_fields(),
            }
            self._append({**first, **self._values(feedback=False)})
        else:
            self._event("resume", step)
        self._open_timeline()

    def stop(self, reason: str, steps_done: int) -> None:
        """The run stops before its last step, with ``steps_done`` steps done, for
        ``reason`` (one of ``STOP_REASONS``)."""
        if reason not in STOP_REASONS:
            raise ValueError(f"a run's stop reason is one of {STOP_REASONS}, got {reason!r}")
        self._event("stop", steps_done, reason=reason)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Observe the nodes and model calls of the block for the traces and the call log."""
        with ExitStack() as stack:
            if self.trace:
                stack.enter_context(observe_nodes(self._on_node))
            if self.trace or self.call_log is not None:
                stack.enter_context(observe_calls(self._on_call))
            yield

    def start_step(self, step: int) -> None:
        """Step ``step`` (1-based, as in the history) begins."""
        self._finish_timeline()
        self.step = step
        self.phase_name = ""
        self._feedback = [None] * len(self.parameters)
        self._calls = 0
        self._open_timeline()

    def phase(self, name: str) -> None:
        """The step enters phase ``name`` (``forward``, ``backward``, ``optimizer step``, ...)."""
        self._end_phase()
        self.phase_name = name
        if self.timeline is not None:
            self._phase_span = self.timeline.add_span(
                "phase", name, time.perf_counter(), None, args={"step": self.step}
            )

    def feedback(self) -> None:
        """Keep each parameter's gradient (its feedback) before the optimizer uses it."""
        self._feedback = [None if p.grad is None else p.grad.data for p in self.parameters]

    def end_step(self, row: Mapping[str, Any]) -> None:
        """The step is done (``row``: its metrics): write its line and its trace."""
        self._end_phase()
        trace = self._finish_timeline()
        line: dict[str, Any] = {
            "step": self.step,
            "time": time.time(),
            **self._values(feedback=True),
            "trace": trace,
            "calls": self._calls,
            "call_log": None if self.call_log_path is None else str(self.call_log_path),
            "metrics": json_value(dict(row)),
            **self._run_fields(),
        }
        self._append(line)

    def close(self) -> None:
        """Write what is left (an unfinished step's trace) and close the call log."""
        self._end_phase()
        self._finish_timeline()
        if self.call_log is not None:
            self.call_log.close()
            self.call_log = None

    # -- observers ----------------------------------------------------------------------
    def _on_node(self, event: Any) -> None:
        if self.timeline is not None:
            self.timeline.on_node(event)

    def _on_call(self, call: ModelCall) -> None:
        self._calls += 1
        if self.timeline is not None:
            self.timeline.on_call(call)
        if self.call_log is not None:
            record = call_record(call)
            record["labels"] = {
                **record["labels"],
                "run": str(self.out.resolve()),
                "step": self.step,
                "phase": self.phase_name,
            }
            if self.timeline is not None:
                record["trace_id"] = self.timeline.trace_id
            try:
                self.call_log.write(record)
            except OSError as exc:
                self._note("call log", exc)

    # -- files --------------------------------------------------------------------------
    def _run_fields(self) -> dict[str, Any]:
        """What every line says of the run it belongs to."""
        return {"forward_on": self.forward_on, "max_cost_usd": self.max_cost_usd}

    def _event(self, event: str, steps_done: int, **fields: Any) -> None:
        line = {"event": event, "time": time.time(), "at_step": steps_done, **fields}
        self._append({**line, **self._run_fields()})

    def _values(self, *, feedback: bool) -> dict[str, Any]:
        params = [
            {"name": n, "role": p.role, "value": json_value(p.data)}
            for n, p in zip(self.names, self.parameters, strict=True)
        ]
        result: dict[str, Any] = {"parameters": params}
        if feedback:
            result["feedback"] = [
                {"name": n, "role": p.role, "feedback": json_value(f)}
                for n, p, f in zip(self.names, self.parameters, self._feedback, strict=True)
            ]
        return result

    def _open_timeline(self) -> None:
        self.timeline = Timeline(name=f"{self.name} step {self.step}") if self.trace else None

    def _end_phase(self) -> None:
        if self._phase_span is not None and self._phase_span.end_s is None:
            self._phase_span.end_s = time.perf_counter()
        self._phase_span = None

    def _finish_timeline(self) -> str | None:
        timeline, self.timeline = self.timeline, None
        if timeline is None or not timeline.spans:
            return None
        timeline.close()
        name = trace_name(self.step)
        try:
            timeline.write(self.out / name)
        except OSError as exc:
            self._note("trace", exc)
            return None
        return name

    def _append(self, line: Mapping[str, Any]) -> None:
        try:
            append_private_line(self.out / STEPS_FILE, line, allow_nan=False)
        except (OSError, ValueError) as exc:
            self._note(STEPS_FILE, exc)

    def _note(self, what: str, exc: Exception) -> None:
        if what not in self._broken:
            self._broken.add(what)
            print(f"note: cannot write the {what} of {self.out}: {exc}", file=sys.stderr)
