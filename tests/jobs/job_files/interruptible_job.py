"""A job file for the Ctrl-C tests: the demo's prompt optimization, able to stop mid-step.

Without ``AG_TEST_HOLD_STEP`` it is an ordinary job (the reference run and the
resumed run). With it, when step ``AG_TEST_HOLD_STEP`` (0-based) reaches
``AG_TEST_HOLD_PHASE``, the job writes the file ``AG_TEST_MARKER`` and then waits
inside that step, so a test can send SIGINT knowing the step is half done:

- ``forward``: the first example of the batch has made its model calls, the
  others are running or done; no backward yet;
- ``backward``: the batch's feedback requests are in flight;
- ``optimizer``: backward is done (the prompt holds its gradient) and TGD's
  request for the new prompt is in flight;
- ``validation``: the initial validation (before step 0) is running: one of
  its examples has made its model calls (``AG_TEST_HOLD_STEP`` must be 0).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncgraph import is_grad_enabled
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.jobs.demo import build_demo_job, demo_responder
from asyncgraph.models import SimulatedModel
from asyncgraph.text import register_model

MODEL = "interruptible-demo"
BATCH_SIZE = 4
HOLD_S = 120.0


class Hold:
    def __init__(self) -> None:
        step = os.environ.get("AG_TEST_HOLD_STEP")
        self.step = int(step) if step else None
        self.phase = os.environ.get("AG_TEST_HOLD_PHASE", "forward")
        self.marker = Path(os.environ.get("AG_TEST_MARKER", "hold-marker"))
        self.train_forwards = 0

    @property
    def current_step(self) -> int:
        return (self.train_forwards - 1) // BATCH_SIZE

    async def at(self, phase: str, *, step: int | None = None) -> None:
        current = self.current_step if step is None else step
        if self.step is None or phase != self.phase or current != self.step:
            return
        if not self.marker.exists():
            tmp = self.marker.with_name(self.marker.name + ".tmp")
            tmp.write_text(f"{phase} {self.step}\n")
            tmp.replace(self.marker)
        await anyio.sleep(HOLD_S)  # until the test's SIGINT cancels the step


def build_job() -> Job:
    hold = Hold()

    async def respond(messages: Sequence[Mapping[str, Any]]) -> str:
        everything = "\n".join(str(m.get("content", "")) for m in messages)
        system = str(messages[0].get("content", "")) if messages else ""
        if "IMPROVED_VARIABLE" in everything:
            await hold.at("optimizer")
        elif "feedback engine" in system:
            await hold.at("backward")
        return demo_responder(messages)

    latency_s = float(os.environ.get("AG_TEST_LATENCY_MS", "10")) / 1000
    model = SimulatedModel(latency_s=latency_s, responder=respond, tag_replies=False)
    register_model(MODEL, model)
    job, _prompt = build_demo_job(MODEL, batch_size=BATCH_SIZE, epochs=2, seed=11)
    job.name = "interruptible-demo"
    inner = job.forward

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        training = is_grad_enabled()
        first_of_step = False
        if training:
            hold.train_forwards += 1
            first_of_step = (hold.train_forwards - 1) % BATCH_SIZE == 0
        evaluation = await inner(example)
        if first_of_step:
            await hold.at("forward")
        elif not training and hold.train_forwards == 0:
            await hold.at("validation", step=0)  # no training step has started yet
        return evaluation

    job.forward = forward
    return job
