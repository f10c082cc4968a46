"""Shared pieces of the job tests: a tiny numeric job with a hand-written reference,
and helpers to run the ``asyncgraph`` command in a subprocess.

The numeric job fits ``y = w * x`` by mini-batch SGD with momentum. Its reference
(``reference_fit``) is the same loop written by hand in plain Python, in the same
batch order (``Job.batch``) and the same summation order (the batch's order, which
is the order the gradients are accumulated in), so parameters compare exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncgraph import Function, Module, Parameter, Variable, is_grad_enabled
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.optim import SGD

REPO = Path(__file__).resolve().parents[2]
JOB_FILES = Path(__file__).resolve().parent / "job_files"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Fields of a history row that measure wall-clock time, not the optimization.
TIMING_FIELDS = frozenset({"step_s"})

LR = 0.02
MOMENTUM = 0.5
TRAIN = [{"x": 0.2 * i, "y": 2.5 * (0.2 * i) + 0.1 * ((i % 3) - 1)} for i in range(1, 13)]
VAL = [{"x": 0.3 + 0.4 * i, "y": 2.5 * (0.3 + 0.4 * i)} for i in range(4)]
BATCH_SIZE = 4  # 12 examples: 3 steps per epoch
EPOCHS = 3

Hook = Callable[[int], Awaitable[None]]


class SquaredError(Function):
    """``(w * x - y) ** 2`` for a Parameter ``w`` and plain numbers ``x``, ``y``.

    The last argument is a probe (any object or None) whose ``on_backward()`` is
    awaited inside the backward, so tests can act in the middle of one.
    """

    @staticmethod
    def forward(ctx: Any, w: Variable, x: float, y: float, probe: Any) -> Variable:
        ctx.residual = w.data * x - y
        ctx.x = x
        ctx.probe = probe
        return Variable(ctx.residual**2, role="squared error")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Any, None, None, None]:
        await anyio.lowlevel.checkpoint()
        if ctx.probe is not None:
            await ctx.probe.on_backward()
        return (2 * ctx.residual * ctx.x * g.data, None, None, None)


class LineFit:
    """A fresh numeric job, with optional hooks for interrupting it.

    ``on_forward(step)`` is awaited in the first forward of every training step
    (after its loss is built), ``on_backward(step)`` in every backward node; ``step``
    is the 0-based index of the step being run, counted by this object (so a job
    resumed at step k counts from k: pass ``start_step``).
    """

    def __init__(
        self,
        *,
        on_forward: Hook | None = None,
        on_backward: Hook | None = None,
        start_step: int = 0,
        name: str = "line-fit",
        batch_size: int = BATCH_SIZE,
        epochs: int = EPOCHS,
        seed: int = 3,
        train: Sequence[Mapping[str, float]] = TRAIN,
        module: bool = False,
    ) -> None:
        self.w = Parameter(0.0, role="slope")
        # module=True: the job takes a Module (the slope is its parameter "line.slope").
        self.module = Module()
        self.module.line = Module()
        self.module.line.slope = self.w
        self.optimizer = SGD([self.w], lr=LR, momentum=MOMENTUM)
        self.on_forward = on_forward
        self.on_backward_hook = on_backward
        self.train_forwards = start_step * batch_size
        self.batch_size = batch_size
        self.job = Job(
            name=name,
            parameters=self.module if module else [self.w],
            optimizer=self.optimizer,
            forward=self.forward,
            train_set=list(train),
            val_set=VAL,
            batch_size=batch_size,
            epochs=epochs,
            validate_every=2,
            max_concurrency=3,
            seed=seed,
        )

    @property
    def step(self) -> int:
        return (self.train_forwards - 1) // self.batch_size

    async def on_backward(self) -> None:
        if self.on_backward_hook is not None:
            await self.on_backward_hook(self.step)

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        training = is_grad_enabled()
        if training:
            self.train_forwards += 1
            first_of_step = (self.train_forwards - 1) % self.batch_size == 0
        await anyio.lowlevel.checkpoint()
        loss = SquaredError.apply(self.w, example["x"], example["y"], self if training else None)
        if training and first_of_step and self.on_forward is not None:
            await self.on_forward(self.step)
        score = float(abs(self.w.data * example["x"] - example["y"]) < 0.25)
        return Evaluation(loss=loss, score=score, prediction=self.w.data * example["x"])


def reference_fit(job: Job, steps: int | None = None) -> tuple[float, float | None]:
    """``(w, momentum_buffer)`` after ``steps`` steps of the hand-written loop."""
    w, buf = 0.0, None
    for step in range(job.total_steps if steps is None else steps):
        grad = 0.0
        for example in job.batch(step):
            grad += 2 * (w * example["x"] - example["y"]) * example["x"]
        buf = grad if buf is None else MOMENTUM * buf + (1 - 0.0) * grad
        w = w - LR * buf
    return w, buf


def without(rows: Sequence[Mapping[str, Any]], fields: frozenset[str]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in fields} for row in rows]


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def read_json(path: Path) -> Any:
    return json.loads(path.read_text("utf-8"))


def run_events(out: Path) -> list[tuple[str, int, str | None]]:
    """The run lines of ``out/steps.jsonl`` (not the steps'): ``(event, at_step, reason)``."""
    lines = [json.loads(line) for line in (out / "steps.jsonl").read_text("utf-8").splitlines()]
    return [(x["event"], x["at_step"], x.get("reason")) for x in lines if "event" in x]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for an ``asyncgraph`` subprocess: this interpreter's, unbuffered."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("ASYNCGRAPH_DEMO_LATENCY_MS", None)
    env.update(extra)
    return env


def run_cli(
    *args: str, timeout_s: float = 120.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m asyncgraph ARGS`` in the repository, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "asyncgraph", *args],
        cwd=REPO,
        env=dict(env) if env is not None else cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed subprocess said, for assertion messages."""
    return (
        f"exit code {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
