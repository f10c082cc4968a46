"""Batch optimization jobs: the loop users write by hand, with checkpoints and resume.

``Job`` describes the work (parameters, optimizer, dataset, a forward that returns an
``Evaluation`` per example); ``await run_job(job, out_dir)`` runs it with concurrent
forwards, ``await backward``, ``await optimizer.step()``, validation, a progress bar, a
checkpoint after every step, ``history.json`` and ``metrics.png``.
"""

from ._checkpoint import CheckpointError
from ._runner import Evaluation, Job, JobResult, evaluate, run_job

__all__ = ["CheckpointError", "Evaluation", "Job", "JobResult", "evaluate", "run_job"]
