"""``MLflowReporter``: a job's run in MLflow, where many teams already look.

The ``mlflow`` extra (``mlflow-skinny``, the client without the server). ``mlflow`` is
imported when a reporter is built, never by ``import asyncgraph.jobs``. It talks to MLflow
through an ``MlflowClient`` and the run's id, never through MLflow's process-wide active
run, so two jobs in one process report to two runs.

What the project hands to MLflow goes through the one redaction and the one private mode
(``asyncgraph._redact``, ``asyncgraph._files``): params (the job's ``config`` redacted
by name too: ``api_key``, a base URL's password), tags, the run's name, the best
parameters' texts (written with ``write_private``, then logged) and the run directory
(written so already). MLflow writes its store with files of its own (params, metrics,
``meta.yaml``, the copies of artifacts): every MLflow call runs under
``private_umask()``, so what it creates on this machine is 0600 / 0700.
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asyncgraph._files import private_umask, write_private
from asyncgraph._install import install_hint
from asyncgraph._redact import redact, redact_data

from ._job import Job
from ._report import Reporter

__all__ = ["MLflowReporter", "job_params", "step_metrics"]

logger = logging.getLogger("asyncgraph.jobs")

_INSTALL = install_hint("mlflow")
# MLflow refuses a param value longer than this (6,000 characters since MLflow 2.x).
_PARAM_CHARS = 6000


def job_params(job: Job) -> dict[str, str]:
    """The run's params: the job's settings, its optimizer, its ``config`` (as
    ``config.KEY``), each as the string MLflow keeps, redacted (the config by name too)."""
    params: dict[str, Any] = {
        "job": job.name,
        "optimizer": type(job.optimizer).__name__,
        "batch_size": job.batch_size,
        "epochs": job.epochs,
        "total_steps": job.total_steps,
        "seed": job.seed,
        "train_examples": len(job.train_set),
        "val_examples": len(job.val_set),
        "max_concurrency": job.max_concurrency,
        "keep_best": job.keep_best,
        "patience": job.patience,
        "max_cost_usd": job.max_cost_usd,
        "forward_on_workers": job.forward_on_workers,
        "parameters": ", ".join(job.param_names or [p.role for p in job.params]),
    }
    for key, value in redact_data(dict(job.config), by_name=True).items():
        params[f"config.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return {redact(key): redact(str(value))[:_PARAM_CHARS] for key, value in params.items()}


def step_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one ``history`` row (scores, loss, tokens, cost, time), as metrics:
    ``step`` is the metric's step, not a metric; a missing validation is left out."""
    return {
        key: float(value)
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _best_values(out_dir: Path, job: Job) -> dict[str, str]:
    """The text of each parameter in ``best.json`` (else their values now), by name."""
    names = job.param_names or [f"{i}-{p.role or 'parameter'}" for i, p in enumerate(job.params)]
    values: list[Any] = [p.data for p in job.params]
    try:
        best = json.loads((out_dir / "best.json").read_text("utf-8"))
    except (OSError, ValueError):
        best = None
    if isinstance(best, dict) and job.module is None:
        saved = [p.get("data") for p in best.get("parameters", []) if isinstance(p, dict)]
        if len(saved) == len(values):
            values = saved
    elif isinstance(best, dict) and isinstance(best.get("module"), dict):
        state = best["module"]
        values = [state.get(name, value) for name, value in zip(names, values, strict=True)]
    safe = ["".join(c if c.isalnum() or c in "-_." else "_" for c in name) for name in names]
    return {
        name: value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        for name, value in zip(safe, values, strict=True)
    }


class MLflowReporter(Reporter):
    """Reports a job to an MLflow run, and shows its progress as ``run_job`` does.

    ``run_job(job, out_dir, reporter=MLflowReporter(job, tracking_uri=...))``: when the
    job starts, a run named ``run_name`` (default: the job's name) is created in the
    experiment ``experiment`` (default: the job's name; created if missing) with the
    job's settings as params (``job_params``) and ``tags``; after every step, that
    step's row of ``history`` is logged as metrics at that step (``train_score``,
    ``train_loss``, ``val_score``, tokens, ``cost_usd``, ``step_s``...); when the job
    ends, the run directory (checkpoint, ``best.json``, ``history.json``,
    ``metrics.png``, ``steps.jsonl``, traces) is logged as the artifacts ``run/``, the
    best parameters (those of ``best.json``, else the final ones) as ``best/NAME.txt``,
    and the run ends ``FINISHED``, ``KILLED`` (Ctrl-C) or ``FAILED``. A resumed job gets a
    new run whose metrics start with the steps done before.

    ``tracking_uri`` defaults to MLflow's (``MLFLOW_TRACKING_URI``); a ``file://``
    directory needs ``MLFLOW_ALLOW_FILE_STORE=true`` with MLflow 3. An MLflow error
    never costs the job: it is logged (logger ``asyncgraph.jobs``) and the job goes on.
    The calls are MLflow's own, synchronous ones: a few milliseconds each on a local
    store, a network round trip each against a tracking server. Raises ``ImportError``
    naming the extra to install when mlflow is not installed. Example::

        reporter = MLflowReporter(job, tracking_uri="http://127.0.0.1:5000")
        result = await run_job(job, "runs/qa", reporter=reporter)
        print(reporter.run_id)
    """

    def __init__(
        self,
        job: Job,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__(job.name, job.total_steps, enabled=progress)
        try:
            tracking = importlib.import_module("mlflow.tracking")
            self._entities = importlib.import_module("mlflow.entities")
        except ImportError as exc:
            raise ImportError(
                f"MLflowReporter needs mlflow, which is not installed: {_INSTALL}"
            ) from exc
        self.job = job
        with private_umask():  # a file store is created as it is opened
            self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        self.experiment = redact(experiment or job.name)
        self.run_name = redact(run_name or job.name)
        self.tags = {redact(k): redact(v) for k, v in dict(tags or {}).items()}
        self.run_id: str | None = None
        self._interrupted = False

    def _safely(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` (MLflow's), its files private; None and a warning if it fails."""
        try:
            with private_umask():
                return call()
        except Exception as exc:  # reporting never costs the job its run
            shown = redact(f"{type(exc).__name__}: {exc}")
            logger.warning("MLflow: could not %s (run %s): %s", what, self.run_id, shown)
            return None

    def _log_rows(self, rows: list[dict[str, Any]]) -> None:
        if self.run_id is None or not rows:
            return
        run_id, now = self.run_id, int(time.time() * 1000)
        metrics = [
            self._entities.Metric(key, value, now, int(row["step"]))
            for row in rows
            for key, value in step_metrics(row).items()
        ]
        self._safely("log metrics", lambda: self.client.log_batch(run_id, metrics=metrics))

    def start(self, step: int, history: list[dict[str, Any]]) -> None:
        super().start(step, history)

        def create() -> str:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(self.experiment)
            )
            tags = {"asyncgraph.job": redact(self.job.name), **self.tags}
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            run_id: str = run.info.run_id
            params = [self._entities.Param(k, v) for k, v in job_params(self.job).items()]
            self.client.log_batch(run_id, params=params)
            return run_id

        self.run_id = self._safely("start a run", create)
        self._log_rows(history)

    def update(self, step: int, row: dict[str, Any]) -> None:
        super().update(step, row)
        self._log_rows([row])

    def stop(self, *, interrupted: bool = False) -> None:
        super().stop(interrupted=interrupted)
        self._interrupted = interrupted

    def end(self, out_dir: Path, error: BaseException | None) -> None:
        if self.run_id is None:
            return
        run_id = self.run_id
        if out_dir.is_dir():
            self._safely(
                "log the run directory",
                lambda: self.client.log_artifacts(run_id, str(out_dir), "run"),
            )

        def log_best() -> None:
            with tempfile.TemporaryDirectory(prefix="asyncgraph-best-") as folder:
                for name, text in _best_values(out_dir, self.job).items():
                    write_private(f"{folder}/{name}.txt", text)
                self.client.log_artifacts(run_id, folder, "best")

        self._safely("log the best parameters", log_best)
        status = "FAILED" if error is not None else "KILLED" if self._interrupted else "FINISHED"
        self._safely("end the run", lambda: self.client.set_terminated(run_id, status))
