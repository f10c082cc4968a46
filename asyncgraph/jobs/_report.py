"""Progress display, metrics history and the metrics plot of a job."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

from asyncgraph._files import write_private
from asyncgraph._install import install_hint
from asyncgraph._redact import redact

from ..models import format_cost
from ._checkpoint import atomic_write_json

__all__ = ["Reporter", "write_history", "write_plot"]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cost(row: dict[str, Any]) -> str:
    """The row's cost; "cost unknown" when calls of unpriced models are in it (never $0),
    "at most" when calls cut before their answer are (an upper bound)."""
    return format_cost(
        float(row["cost_usd"]),
        int(row.get("unpriced_calls", 0)),
        upper_bound=int(row.get("cut_calls", 0)) > 0,
    )


def _skipped(row: dict[str, Any]) -> str:
    """What a step skipped, for its progress line ("" when nothing)."""
    parts = []
    updates = len(row.get("skipped_updates") or ())
    examples = len(row.get("skipped_examples") or ())
    if updates:
        parts.append(f"{updates} update{'s' if updates > 1 else ''} skipped (unreadable reply)")
    if examples:
        parts.append(
            f"{examples} example{'s' if examples > 1 else ''} skipped (unreadable verdict)"
        )
    return "  " + ", ".join(parts) if parts else ""


def _tokens(count: int) -> str:
    if count < 10_000:
        return f"{count:,}"
    if count < 10_000_000:
        return f"{count / 1000:.0f}k"
    return f"{count / 1_000_000:.0f}M"


class Reporter:
    """A rich progress bar (when stderr is a terminal) or one line per step (elsewhere).

    The bar goes to stderr, the stream whose ``isatty()`` chose it; the plain
    lines go to stdout. On a narrow terminal the bar keeps its name, bar, M/N
    and elapsed time, and cuts the metrics short (with an ellipsis).
    """

    # The widths that fit an 80-column terminal: name, bar, "12/12", "0:01:23", and
    # the rest (about 30 columns) for the metrics.
    NAME_WIDTH = 20
    NAME_MAX_WIDTH = 32  # a longer name is cut (with an ellipsis) only past this
    BAR_WIDTH = 16

    def __init__(self, name: str, total_steps: int, *, enabled: bool = True) -> None:
        self.name = name
        self.total = total_steps
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None
        # The last row with a validation score: steps without validation show that one.
        self._validated: list[dict[str, Any]] = []

    def start(self, step: int, history: list[dict[str, Any]]) -> None:
        self._validated = [h for h in history if h["val_score"] is not None][-1:]
        if not self.enabled:
            return
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.table import Column

            console = Console(stderr=True)
            # Three columns free: the "^C" a terminal echoes on Ctrl-C then fits on the
            # bar's line instead of wrapping to a new one (which left the bar twice).
            console.width = max(40, console.width - 3)
            self._progress = Progress(
                TextColumn(
                    "[bold]{task.description}",
                    table_column=Column(
                        max_width=max(self.NAME_WIDTH, min(len(self.name), self.NAME_MAX_WIDTH)),
                        no_wrap=True,
                        overflow="ellipsis",
                    ),
                ),
                BarColumn(bar_width=self.BAR_WIDTH),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn(
                    "{task.fields[metrics]}",
                    table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
                ),
                console=console,
                transient=False,
                # Expand: the metrics column (ratio 1) gets the width the others leave, and
                # is cut short there; without it rich shrinks every column, elapsed time too.
                expand=True,
            )
            self._task = self._progress.add_task(
                self.name,
                total=self.total,
                completed=step,
                metrics=self._compact(self._rows(history)),
            )
            self._progress.start()
        elif step:
            print(f"{self.name}: resuming after step {step}/{self.total}", flush=True)

    @staticmethod
    def _rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        validated = [h for h in history if h["val_score"] is not None][-1:]
        return [*validated, history[-1]] if history else []

    @staticmethod
    def _val(rows: list[dict[str, Any]]) -> float | None:
        return next((x["val_score"] for x in reversed(rows) if x["val_score"] is not None), None)

    @classmethod
    def _metrics(cls, rows: list[dict[str, Any]]) -> str:
        """The metrics of a plain progress line (all of them, spelled out)."""
        if not rows:
            return ""
        h = rows[-1]
        return (
            f"loss {h['train_loss']:.2f}  acc {h['train_score']:.2f}  val {_fmt(cls._val(rows))}  "
            f"tokens {h['tokens']:,}  {_cost(h)}{_skipped(h)}"
        )

    @classmethod
    def _compact(cls, rows: list[dict[str, Any]]) -> str:
        """The metrics next to the bar: short, most important first (the end may be cut)."""
        if not rows:
            return ""
        h = rows[-1]
        return (
            f"loss {h['train_loss']:.2f} acc {h['train_score']:.2f} val {_fmt(cls._val(rows))} "
            f"{_tokens(int(h['tokens']))} tok {_cost(h)}{_skipped(h)}"
        )

    def update(self, step: int, row: dict[str, Any]) -> None:
        if row["val_score"] is not None:
            self._validated = [row]
        if not self.enabled:
            return
        rows = [*self._validated, row]
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=self._compact(rows))
        else:
            print(f"{self.name}: step {step}/{self.total}  {self._metrics(rows)}", flush=True)

    def end(self, out_dir: Path, error: BaseException | None) -> None:
        """Called once when ``run_job`` has written the run directory's records
        (``history.json``, ``metrics.png``), with the job's error if it failed or was
        cancelled: a reporter that keeps the run somewhere else copies them here."""

    def stop(self, *, interrupted: bool = False) -> None:
        """Stop the live bar. After Ctrl-C the terminal has echoed ``^C`` into the bar's
        line, so rich's final render would print the bar a second time below it: the bar
        is erased instead, and one plain line says where the job stopped."""
        if self._progress is None:
            return
        progress, self._progress = self._progress, None
        if interrupted:
            task = progress.tasks[0] if progress.tasks else None
            progress.live.transient = True
            progress.stop()
            step = int(task.completed) if task is not None else 0
            metrics = task.fields.get("metrics", "") if task is not None else ""
            progress.console.print(
                f"{self.name}: interrupted after step {step}/{self.total}  {metrics}".rstrip(),
                highlight=False,
                markup=False,
            )
        else:
            progress.stop()


def write_history(path: Path, history: list[dict[str, Any]]) -> None:
    atomic_write_json(path, {"history": history})


def write_plot(
    path: Path, history: list[dict[str, Any]], title: str, initial_val: float | None = None
) -> bool:
    """Draw the metrics per step to a PNG; False (and a note on stderr) if matplotlib is missing.

    Two panels: the score (train per step, validation with the initial one at
    step 0) and the training loss.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"note: matplotlib is not installed, so {path} was not drawn "
            f"({install_hint('plot')}); the history is in history.json",
            file=sys.stderr,
        )
        return False
    steps = [h["step"] for h in history]
    fig, (score_ax, loss_ax) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=100)
    score_ax.plot(steps, [h["train_score"] for h in history], marker="o", label="train")
    val = [(h["step"], h["val_score"]) for h in history if h["val_score"] is not None]
    if initial_val is not None:
        val.insert(0, (0, initial_val))
    if val:
        score_ax.plot([s for s, _ in val], [v for _, v in val], marker="s", label="validation")
    score_ax.set_xlabel("step")
    score_ax.set_ylabel("score")
    score_ax.set_ylim(-0.05, 1.05)
    score_ax.set_title("score")
    score_ax.grid(alpha=0.3)
    score_ax.legend(loc="lower right")
    loss_ax.plot(
        steps, [h["train_loss"] for h in history], marker="o", color="tab:red", label="train loss"
    )
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training loss")
    loss_ax.grid(alpha=0.3)
    fig.suptitle(redact(title))  # a picture cannot be redacted once drawn
    fig.tight_layout()
    picture = io.BytesIO()
    try:
        fig.savefig(picture, format="png")
    finally:
        plt.close(fig)
    write_private(path, picture.getvalue())  # as every file of a run
    return True
