"""A job file whose scripted optimizer walks through fixed prompts, for the keep-best and
``asyncgraph eval`` tests: validation peaks at step 3 ("v3"), the test split scores each
prompt differently. ``BEST_JOB_NO_TEST=1`` builds it without a test_set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from asyncgraph import Module, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job

VALUES = ["v0", "v1", "v2", "v3", "v4", "v5", "v6"]
# Score of each prompt on each split ("val" and "test" rows have a "split" key).
SCORES = {
    "val": {"v0": 0.2, "v1": 0.5, "v2": 0.3, "v3": 0.6, "v4": 0.4, "v5": 0.4, "v6": 0.5},
    "test": {"v0": 0.0, "v1": 0.25, "v2": 0.25, "v3": 0.75, "v4": 0.5, "v5": 0.5, "v6": 0.5},
    "train": {v: 0.5 for v in VALUES},
}


class Scripted:
    def __init__(self, param: Parameter) -> None:
        self.param, self.steps = param, 0

    def zero_grad(self) -> None:
        self.param.grad = None

    async def step(self) -> None:
        self.steps += 1
        self.param.data = VALUES[self.steps]

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])


class Program(Module):
    def __init__(self) -> None:
        super().__init__()
        self.prompt = Parameter("v0", role="prompt")

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        loss = self.prompt + Variable(" is wrong")
        return Evaluation(loss=loss, score=SCORES[example["split"]][self.prompt.data])


def build_job() -> Job:
    program = Program()
    no_test = os.environ.get("BEST_JOB_NO_TEST") == "1"
    return Job(
        name="best-job",
        parameters=program,
        optimizer=Scripted(program.prompt),
        forward=program,
        train_set=[{"split": "train", "i": i} for i in range(6)],
        val_set=[{"split": "val", "i": i} for i in range(2)],
        test_set=[] if no_test else [{"split": "test", "i": i} for i in range(4)],
        batch_size=1,
        keep_best=True,
    )
