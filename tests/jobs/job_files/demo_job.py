"""A job file running the shipped demo job for one epoch on the "demo" model.

Workers started with ``--import asyncgraph.text --import asyncgraph.jobs.demo``
resolve that model too, so ``asyncgraph run demo_job.py --redis URL`` runs its
backward on them. The simulated latency comes from ``ASYNCGRAPH_DEMO_LATENCY_MS``
(read when ``asyncgraph.jobs.demo`` is imported, here and in the workers).
"""

from __future__ import annotations

import os

from asyncgraph.jobs import Job
from asyncgraph.jobs.demo import LATENCY_ENV, build_demo_job


def build_job() -> Job:
    job, _prompt = build_demo_job(epochs=1, latency_ms=float(os.environ.get(LATENCY_ENV, "100")))
    return job
