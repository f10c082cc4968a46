"""``MLflowReporter``: a job's params, per-step metrics, best parameters and run
directory in MLflow, checked against a local file store."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph.jobs import MLflowReporter, run_job

from .jobs_helpers import LineFit, read_json

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")

pytestmark = pytest.mark.anyio


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    return (tmp_path / "mlruns").as_uri()


def client(store: str) -> Any:
    return mlflow.tracking.MlflowClient(tracking_uri=store)


def artifacts(store: str, run_id: str, path: str = "") -> list[str]:
    found = []
    for item in client(store).list_artifacts(run_id, path):
        found += artifacts(store, run_id, item.path) if item.is_dir else [item.path]
    return sorted(found)


async def test_a_job_logs_its_params_every_steps_metrics_and_its_run_directory(
    tmp_path: Path, store: str
) -> None:
    fit = LineFit()
    fit.job.config = {"lr": 0.02, "note": "first"}
    reporter = MLflowReporter(fit.job, tracking_uri=store, experiment="fits", progress=False)
    result = await run_job(fit.job, tmp_path / "run", reporter=reporter)
    assert reporter.run_id is not None
    run = client(store).get_run(reporter.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "line-fit"
    assert client(store).get_experiment(run.info.experiment_id).name == "fits"
    params = run.data.params
    assert params["optimizer"] == "SGD" and params["batch_size"] == "4"
    assert params["config.lr"] == "0.02" and params["config.note"] == "first"
    # Every step's row, at its step: the history's numbers exactly.
    for key in ("train_score", "train_loss"):
        logged = client(store).get_metric_history(reporter.run_id, key)
        assert [(m.step, m.value) for m in sorted(logged, key=lambda m: m.step)] == [
            (row["step"], row[key]) for row in result.history
        ]
    validated = client(store).get_metric_history(reporter.run_id, "val_score")
    assert sorted(m.step for m in validated) == [
        row["step"] for row in result.history if row["val_score"] is not None
    ]
    files = artifacts(store, reporter.run_id)
    for name in ("checkpoint.json", "history.json", "best.json"):
        assert f"run/{name}" in files
    best = read_json(tmp_path / "run" / "best.json")["parameters"][0]["data"]
    text = client(store).download_artifacts(reporter.run_id, "best/0-slope.txt", str(tmp_path))
    assert await anyio.Path(text).read_text() == str(best)


async def test_a_failed_job_ends_its_run_failed(tmp_path: Path, store: str) -> None:
    async def broken(step: int) -> None:
        if step == 1:
            raise RuntimeError("the model went away")

    fit = LineFit(on_forward=broken)
    reporter = MLflowReporter(fit.job, tracking_uri=store, progress=False)
    with pytest.raises(Exception) as caught:  # the forwards' task group holds it
        await run_job(fit.job, tmp_path / "run", reporter=reporter)
    assert "the model went away" in repr(caught.value)
    assert reporter.run_id is not None
    run = client(store).get_run(reporter.run_id)
    assert run.info.status == "FAILED"
    assert len(client(store).get_metric_history(reporter.run_id, "train_score")) == 1


async def test_a_cancelled_job_ends_its_run_failed_with_the_steps_done(
    tmp_path: Path, store: str
) -> None:
    stalled = anyio.Event()

    async def stall(step: int) -> None:
        if step == 2:
            stalled.set()
            await anyio.sleep_forever()

    fit = LineFit(on_forward=stall)
    reporter = MLflowReporter(fit.job, tracking_uri=store, progress=False)
    # A deadline for a loaded machine (the job's two steps and MLflow's writes), not a
    # timing assertion.
    with anyio.move_on_after(120) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(run_job, fit.job, tmp_path / "run", reporter=reporter))
            await stalled.wait()
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert reporter.run_id is not None
    assert client(store).get_run(reporter.run_id).info.status == "FAILED"
    assert len(client(store).get_metric_history(reporter.run_id, "train_score")) == 2


async def test_a_job_stopped_by_ctrl_c_ends_its_run_killed_and_a_resume_starts_another(
    tmp_path: Path, store: str
) -> None:
    async def interrupt(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this step's forward runs
            await anyio.sleep(30)

    fit = LineFit(on_forward=interrupt)
    reporter = MLflowReporter(fit.job, tracking_uri=store, progress=False)
    with anyio.fail_after(30):
        result = await run_job(fit.job, tmp_path / "run", reporter=reporter, handle_sigint=True)
    assert result.interrupted and result.steps_done == 3
    assert reporter.run_id is not None
    stopped = client(store).get_run(reporter.run_id)
    assert stopped.info.status == "KILLED"
    assert len(client(store).get_metric_history(reporter.run_id, "train_score")) == 3
    # The resume is a run of its own, which finishes and logs the steps it made.
    again = LineFit()
    resumed = MLflowReporter(again.job, tracking_uri=store, progress=False)
    final = await run_job(again.job, tmp_path / "run", resume=True, reporter=resumed)
    assert resumed.run_id not in (None, reporter.run_id)
    assert client(store).get_run(resumed.run_id).info.status == "FINISHED"
    assert final.steps_done == again.job.total_steps


async def test_an_unreachable_tracking_store_never_costs_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, store: str
) -> None:
    fit = LineFit()
    reporter = MLflowReporter(fit.job, tracking_uri=store, progress=False)
    # The store goes away under the reporter: every MLflow call of the run fails.
    mlruns = tmp_path / "mlruns"
    shutil.rmtree(mlruns)
    mlruns.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="asyncgraph.jobs"):
        result = await run_job(fit.job, tmp_path / "run", reporter=reporter)
    assert result.steps_done == fit.job.total_steps
    assert "MLflow: could not start a run" in caplog.text


def test_without_mlflow_the_reporter_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ImportError, match=r"pip install 'asyncgraph\[mlflow\]'"):
        MLflowReporter(LineFit().job)
