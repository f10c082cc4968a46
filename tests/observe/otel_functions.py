"""Remote Functions for the OpenTelemetry test (served by real workers: ``--import otel_functions``)."""

from __future__ import annotations

from typing import Any

import anyio

from asyncgraph import Function, Variable


class Remote(Function):
    """Text: its backward sleeps a little on a worker and answers with feedback."""

    dispatch = "remote"
    remote_name = "otel-test.remote"  # the same name whatever the importing module is called

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(f"out of {x.data}", role="output")

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> str:
        await anyio.sleep(0.05)
        return "feedback from a worker"
