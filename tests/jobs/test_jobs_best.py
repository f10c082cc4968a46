"""Jobs that keep the best: best.json, keep_best reverts, patience, resume, load_parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Module, Parameter, Variable, is_grad_enabled
from asyncgraph.jobs import CheckpointError, Evaluation, Job, load_parameters, run_job

from .jobs_helpers import run_events

pytestmark = pytest.mark.anyio

# The value the scripted optimizer sets at each step, and its validation score.
VALUES = ["v0", "v1", "v2", "v3", "v4", "v5", "v6"]
SCORES = {"v0": 0.2, "v1": 0.5, "v2": 0.3, "v3": 0.6, "v4": 0.4, "v5": 0.4, "v6": 0.5}
TRAIN = [{"x": i} for i in range(6)]  # batch 1: 6 steps
VAL = [{"x": 0}, {"x": 1}]


class Scripted:
    """An optimizer that sets the parameter to VALUES[k] at its k-th step."""

    def __init__(self, param: Parameter) -> None:
        self.param = param
        self.steps = 0

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
        self.fail_at: int | None = None
        self.forwards = 0

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        if is_grad_enabled():
            self.forwards += 1
            if self.fail_at is not None and self.forwards == self.fail_at:
                raise RuntimeError("interrupted")
        loss = self.prompt + Variable(" is wrong")
        return Evaluation(loss=loss, score=SCORES[self.prompt.data])


def make_job(module: bool = True, **options: Any) -> tuple[Job, Program]:
    program = Program()
    job = Job(
        name="best-job",
        parameters=program if module else [program.prompt],
        optimizer=Scripted(program.prompt),
        forward=program,
        train_set=TRAIN,
        val_set=VAL,
        test_set=[{"x": 9}],
        batch_size=1,
        **options,
    )
    return job, program


def read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


async def test_best_json_holds_the_best_validated_parameters(tmp_path: Path) -> None:
    job, program = make_job()
    result = await run_job(job, tmp_path, progress=False)
    assert program.prompt.data == "v6"  # without keep_best the last step's values stay
    best = read(tmp_path / "best.json")
    assert best["format"] == "asyncgraph-best" and best["job"] == "best-job"
    assert (best["step"], best["val_score"], best["module"]) == (3, 0.6, {"prompt": "v3"})
    assert (result.best_step, result.best_val_score) == (3, 0.6)
    assert result.best_parameters == ["v3"] and result.best_path == tmp_path / "best.json"
    assert "reverted" not in result.history[0]


async def test_a_list_job_writes_its_parameters_by_role(tmp_path: Path) -> None:
    job, _ = make_job(module=False)
    await run_job(job, tmp_path, progress=False)
    assert read(tmp_path / "best.json")["parameters"] == [{"role": "prompt", "data": "v3"}]


async def test_keep_best_reverts_a_step_that_lowered_validation(tmp_path: Path) -> None:
    job, program = make_job(keep_best=True)
    result = await run_job(job, tmp_path, progress=False)
    reverted = [row["reverted"] for row in result.history]
    # v2 < v1 and v4, v5 < v3: reverted; v6 (0.5) is lower than v3 too.
    assert reverted == [False, True, False, True, True, True]
    assert [row["val_score"] for row in result.history] == [0.5, 0.3, 0.6, 0.4, 0.4, 0.5]
    assert program.prompt.data == "v3"  # the job ends on its best parameters
    assert read(tmp_path / "checkpoint.json")["module"] == {"prompt": "v3"}


async def test_patience_stops_early_and_a_resume_says_finished(tmp_path: Path) -> None:
    job, _ = make_job(patience=2)
    result = await run_job(job, tmp_path, progress=False)
    # Best at step 3 (0.6); steps 4 and 5 bring nothing better: stop after step 5.
    assert result.stopped_early and result.steps_done == 5 and len(result.history) == 5
    assert run_events(tmp_path) == [("stop", 5, "patience")]  # what the dashboard reads
    again, _ = make_job(patience=2)
    resumed = await run_job(again, tmp_path, progress=False, resume=True)
    assert resumed.already_finished and resumed.stopped_early and resumed.best_step == 3


async def test_an_interrupted_job_resumes_with_its_best(tmp_path: Path) -> None:
    whole, _ = make_job(keep_best=True, patience=3)
    expected = await run_job(whole, tmp_path / "whole", progress=False)

    job, program = make_job(keep_best=True, patience=3)
    program.fail_at = 5  # the forward of step 5 fails: steps 1-4 are checkpointed
    with pytest.raises(ExceptionGroup) as failed:  # the forwards' task group
        await run_job(job, tmp_path / "cut", progress=False)
    assert failed.group_contains(RuntimeError, match="interrupted")
    assert run_events(tmp_path / "cut") == []  # a failure is no stop of the dashboard's
    again, _ = make_job(keep_best=True, patience=3)
    result = await run_job(again, tmp_path / "cut", progress=False, resume=True)
    assert run_events(tmp_path / "cut") == [("resume", 4, None)]
    strip = [{k: v for k, v in row.items() if k != "step_s"} for row in result.history]
    want = [{k: v for k, v in row.items() if k != "step_s"} for row in expected.history]
    assert strip == want
    assert (result.best_step, result.stopped_early) == (expected.best_step, expected.stopped_early)
    assert read(tmp_path / "cut" / "best.json") == read(tmp_path / "whole" / "best.json")


async def test_load_parameters_from_best_json_and_refusals(tmp_path: Path) -> None:
    job, _ = make_job()
    await run_job(job, tmp_path, progress=False)
    fresh, program = make_job()
    load_parameters(fresh, tmp_path / "best.json")
    assert program.prompt.data == "v3"
    load_parameters(fresh, tmp_path / "checkpoint.json")  # a checkpoint's values work too
    assert program.prompt.data == "v6"
    program.save(tmp_path / "saved.json")
    listed, _ = make_job(module=False)
    with pytest.raises(CheckpointError, match=r"not a best\.json"):
        load_parameters(listed, tmp_path / "saved.json")  # a Module file, a list job
    (tmp_path / "other.json").write_text(
        json.dumps({"format": "asyncgraph-best", "module": {"other": "x"}})
    )
    with pytest.raises(CheckpointError, match="does not hold parameters of job"):
        load_parameters(fresh, tmp_path / "other.json")
    assert program.prompt.data == "v6"  # unchanged
    with pytest.raises(CheckpointError, match="no parameters file"):
        load_parameters(fresh, tmp_path / "missing.json")


def test_keep_best_and_patience_need_a_val_set() -> None:
    program = Program()
    with pytest.raises(ValueError, match="need a val_set"):
        Job(
            name="x",
            parameters=program,
            optimizer=Scripted(program.prompt),
            forward=program,
            train_set=TRAIN,
            keep_best=True,
        )
    with pytest.raises(ValueError, match="patience must be a positive int"):
        make_job(patience=0)
