"""A job whose loss and metric are remote Functions with async forwards, run with
``forward_on_workers=True``: ``asyncgraph run fleet_job.py --workers 2``. The loss comes
from a module (``fleet_functions``: ``tests/jobs`` on ``PYTHONPATH``), the metric is this
file's own (the workers import this file as ``fleet_job``: hence its ``remote_name``).
Each forward appends ``CLIENT_PID FORWARD_PID`` to the file named by ``$FLEET_JOB_PIDS``."""

import os

from fleet_functions import RemoteSquaredError

from asyncgraph import Function, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.optim import SGD

TRAIN = [{"x": 0.2 * i, "y": 0.5 * i} for i in range(1, 9)]


class ForwardPid(Function):
    dispatch = "remote"
    remote_name = "fleet-job.forward-pid"  # one name, however the file was imported

    @staticmethod
    async def forward(ctx, x):
        return Variable(os.getpid())

    @staticmethod
    def backward(ctx, g):
        return None


def build_job() -> Job:
    w = Parameter(0.0, role="slope")

    async def forward(example):
        loss = await RemoteSquaredError.apply(w, example["x"], example["y"])
        pid = await ForwardPid.apply(example["x"])
        with open(os.environ["FLEET_JOB_PIDS"], "a") as f:  # noqa: ASYNC230 (a test's line)
            f.write(f"{os.getpid()} {pid.data}\n")
        return Evaluation(loss=loss, score=float(loss.data < 0.1))

    return Job(
        name="fleet-job",
        parameters=[w],
        optimizer=SGD([w], lr=0.05),
        forward=forward,
        train_set=TRAIN,
        val_set=TRAIN[:2],
        batch_size=4,
        forward_on_workers=True,
    )
