"""Batch optimization jobs: the loop users write by hand, with checkpoints and resume.

``Job`` describes the work (parameters, optimizer, dataset, a forward that returns an
``Evaluation`` per example, and the ``config`` a resume must match); ``await
run_job(job, out_dir)`` runs it with concurrent forwards, ``await backward``, ``await
optimizer.step()``, validation, a progress bar, a checkpoint after every step (from
step 0, before the initial validation), ``history.json`` and ``metrics.png``.
``resume=True`` continues a checkpoint; an existing one is otherwise refused unless
``overwrite=True``. Every unusable checkpoint raises ``CheckpointError``.

One concept a module: ``_job`` the spec (``Job``, ``Evaluation``, ``JobResult``),
``_checkpoint`` the run directory's files of parameters (writing, checking, resuming,
``load_parameters``), ``_runner`` the run loop (``run_job``, ``evaluate``), ``_report``
and ``_record`` what a run shows and leaves behind, ``_mlflow`` the same run in MLflow
(``MLflowReporter``, the ``mlflow`` extra), ``_*_cli`` the commands, ``_ui`` the
dashboard. ``_checkpoint`` names ``Job`` in annotations only (``_job`` takes its
``fingerprint_data``); ``_runner`` imports both, the commands import ``_runner``.
"""

from typing import TYPE_CHECKING

from asyncgraph._lazy import lazy_exports

if TYPE_CHECKING:  # loaded on first use (``asyncgraph._lazy``): a command's --help needs none
    from ._checkpoint import CheckpointError, load_parameters
    from ._job import Evaluation, Job, JobResult
    from ._mlflow import MLflowReporter
    from ._runner import evaluate, run_job

__all__ = [
    "CheckpointError",
    "Evaluation",
    "Job",
    "JobResult",
    "MLflowReporter",
    "evaluate",
    "load_parameters",
    "run_job",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CheckpointError": "._checkpoint",
        "Evaluation": "._job",
        "Job": "._job",
        "JobResult": "._job",
        "MLflowReporter": "._mlflow",
        "evaluate": "._runner",
        "load_parameters": "._checkpoint",
        "run_job": "._runner",
    },
)
