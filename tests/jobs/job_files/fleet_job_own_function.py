"""A job file that defines its own remote Function: local workers cannot import it."""

from typing import ClassVar

from asyncgraph import Function, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.optim import SGD


class Inline(Function):
    dispatch: ClassVar[str] = "remote"

    @staticmethod
    async def forward(ctx, x):
        return Variable(x.data)

    @staticmethod
    def backward(ctx, g):
        return g


def build_job() -> Job:
    w = Parameter(0.0)

    async def forward(example):
        return Evaluation(loss=await Inline.apply(w), score=0.0)

    return Job(
        name="own",
        parameters=[w],
        optimizer=SGD([w], lr=0.1),
        forward=forward,
        train_set=[{"x": 1}],
    )
