"""A job over a ``Module``: the checkpoint holds its ``state_dict()``, resume loads it back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import BackwardError, Module, Parameter
from asyncgraph.jobs import CheckpointError, Job, run_job

from .jobs_helpers import EPOCHS, TIMING_FIELDS, LineFit, read_json, without

STEPS = EPOCHS * 3

pytestmark = pytest.mark.anyio


async def test_a_module_job_checkpoints_its_state_dict_and_ends_like_a_plain_job(
    tmp_path: Path,
) -> None:
    plain = await run_job(LineFit().job, tmp_path / "plain", progress=False)
    fit = LineFit(module=True)
    assert fit.job.module is fit.module and fit.job.params == [fit.w]
    assert fit.job.param_names == ["line.slope"]
    result = await run_job(fit.job, tmp_path / "module", progress=False)
    assert result.parameters == plain.parameters
    assert without(result.history, TIMING_FIELDS) == without(plain.history, TIMING_FIELDS)

    ckpt = read_json(tmp_path / "module" / "checkpoint.json")
    assert ckpt["module"] == fit.module.state_dict() == {"line.slope": result.parameters[0]}
    assert ckpt["parameters"] == [{"name": "line.slope", "role": "slope"}]
    assert ckpt["job"]["module"] == ["line.slope"]
    # What a user does with it: load the learned values into a fresh Module.
    fresh = LineFit(module=True)
    fresh.module.load_state_dict(ckpt["module"])
    assert fresh.w.data == result.parameters[0]


async def test_resume_of_a_module_job_goes_through_load_state_dict(tmp_path: Path) -> None:
    full = LineFit(module=True)
    uninterrupted = await run_job(full.job, tmp_path / "full", progress=False)

    async def crash(step: int) -> None:
        if step == 4:
            raise RuntimeError("worker lost its network")

    with pytest.raises(BackwardError):
        await run_job(LineFit(on_backward=crash, module=True).job, tmp_path / "run", progress=False)
    assert read_json(tmp_path / "run" / "checkpoint.json")["step"] == 4

    resumed_fit = LineFit(module=True)
    resumed = await run_job(resumed_fit.job, tmp_path / "run", resume=True, progress=False)
    assert resumed.steps_done == STEPS
    assert resumed.parameters == uninterrupted.parameters
    assert resumed_fit.optimizer.state_dict() == full.optimizer.state_dict()
    assert without(resumed.history, TIMING_FIELDS) == without(uninterrupted.history, TIMING_FIELDS)


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    ckpt = read_json(path)
    change(ckpt)
    path.write_text(json.dumps(ckpt))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ck: ck.pop("module"), "field 'module' (the Module's state_dict) is missing"),
        (
            lambda ck: ck.update(module={"line.intercept": 1.0}),
            "missing: ['line.slope']; unexpected: ['line.intercept']",
        ),
        (
            lambda ck: ck["module"].update({"line.slope": "steep"}),
            "a str, but the parameter holds a number",
        ),
        (
            lambda ck: ck.update(parameters=[{"name": "slope", "role": "slope"}]),
            "not the 1 {name, role} maps of Module's parameters",
        ),
        (
            lambda ck: ck["optimizer"].update(param_groups=[]),
            "optimizer state does not load",
        ),
        (  # used to pass the resume, then fail a keep_best revert or the result
            lambda ck: ck["best"]["module"].update({"line.slope": "steep"}),
            "the parameters of 'best': its 'module' state does not load",
        ),
    ],
)
async def test_a_damaged_module_checkpoint_is_refused_and_changes_nothing(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    await run_job(LineFit(module=True, epochs=1).job, tmp_path, progress=False)
    _edit(tmp_path / "checkpoint.json", change)
    fit = LineFit(module=True, epochs=1)
    fit.w.data = 7.0
    before = fit.optimizer.state_dict()
    with pytest.raises(CheckpointError, match="is corrupt") as info:
        await run_job(fit.job, tmp_path, resume=True, progress=False)
    assert message in str(info.value)
    assert fit.w.data == 7.0 and fit.optimizer.state_dict() == before


async def test_a_module_with_other_parameters_does_not_resume_the_checkpoint(
    tmp_path: Path,
) -> None:
    await run_job(LineFit(module=True, epochs=1).job, tmp_path, progress=False)
    fit = LineFit(module=True, epochs=1)
    renamed = Module()  # the same slope under another name: another program
    renamed.line = Module()
    renamed.line.gradient = fit.w
    job = dataclasses.replace(fit.job, parameters=renamed)
    with pytest.raises(CheckpointError, match="belongs to a different job: module is"):
        await run_job(job, tmp_path, resume=True, progress=False)


def test_a_module_without_parameters_is_refused() -> None:
    fit = LineFit()

    class Empty(Module):
        pass

    with pytest.raises(ValueError, match="its Module Empty has no parameters to optimize"):
        Job(
            name="empty",
            parameters=Empty(),
            optimizer=fit.optimizer,
            forward=fit.forward,
            train_set=[{"x": 1.0, "y": 1.0}],
        )
    # A Module with a parameter is as good as the list of its parameters.
    holder = Module()
    holder.w = Parameter(0.0, role="slope")
    job = Job(name="one", parameters=holder, optimizer=fit.optimizer, forward=fit.forward,
              train_set=[{"x": 1.0, "y": 1.0}])  # fmt: skip
    assert job.params == [holder.w] and job.param_names == ["w"]
