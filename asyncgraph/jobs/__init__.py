"""Batch optimization jobs: the loop users write by hand, with checkpoints and resume.

``Job`` describes the work (parameters, optimizer, dataset, a forward that returns an
``Evaluation`` per example, and the ``config`` a resume must match); ``await
run_job(job, out_dir)`` runs it with concurrent forwards, ``await backward``, ``await
optimizer.step()``, validation, a progress bar, a checkpoint after every step (from
step 0, before the initial validation), ``history.json`` and ``metrics.png``.
``resume=True`` continues a checkpoint; an existing one is otherwise refused unless
``overwrite=True``. Every unusable checkpoint raises ``CheckpointError``.
"""

from ._checkpoint import CheckpointError
from ._runner import Evaluation, Job, JobResult, evaluate, load_parameters, run_job

__all__ = [
    "CheckpointError",
    "Evaluation",
    "Job",
    "JobResult",
    "evaluate",
    "load_parameters",
    "run_job",
]
