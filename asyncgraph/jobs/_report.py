"""Progress display, metrics history and the metrics plot of a job."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ._checkpoint import atomic_write_json

__all__ = ["Reporter", "write_history", "write_plot"]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class Reporter:
    """A rich progress bar (on a terminal) or one line per step (elsewhere)."""

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
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[metrics]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._progress.add_task(
                self.name, total=self.total, completed=step, metrics=self._metrics(history)
            )
            self._progress.start()
        elif step:
            print(f"{self.name}: resuming at step {step}/{self.total}", flush=True)

    @staticmethod
    def _metrics(history: list[dict[str, Any]]) -> str:
        if not history:
            return ""
        h = history[-1]
        val = next((x["val_score"] for x in reversed(history) if x["val_score"] is not None), None)
        return (
            f"loss {h['train_loss']:.2f}  acc {h['train_score']:.2f}  val {_fmt(val)}  "
            f"tokens {h['tokens']:,}  ${h['cost_usd']:.4f}"
        )

    def update(self, step: int, row: dict[str, Any]) -> None:
        if row["val_score"] is not None:
            self._validated = [row]
        if not self.enabled:
            return
        metrics = self._metrics([*self._validated, row])
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=metrics)
        else:
            print(f"{self.name}: step {step}/{self.total}  {metrics}", flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def write_history(path: Path, history: list[dict[str, Any]]) -> None:
    atomic_write_json(path, {"history": history})


def write_plot(
    path: Path, history: list[dict[str, Any]], title: str, initial_val: float | None = None
) -> bool:
    """Plot train and validation scores per step to a PNG; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"note: matplotlib is not installed, so {path} was not drawn "
            f"(pip install 'asyncgraph[plot]'); the history is in history.json",
            file=sys.stderr,
        )
        return False
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, [h["train_score"] for h in history], marker="o", label="train score")
    val = [(h["step"], h["val_score"]) for h in history if h["val_score"] is not None]
    if initial_val is not None:
        val.insert(0, (0, initial_val))
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], marker="s", label="validation score")
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
