"""The functions a fleet serves by default (``ASYNCGRAPH_IMPORTS`` adds or replaces modules).

Clients send work here by using these Functions (with ``dispatch = "remote"``)
in their graphs; the worker looks names up only in the modules it imported.
Add your application's function modules to ``ASYNCGRAPH_IMPORTS`` and ship
them in the image (see deploy/).
"""

from __future__ import annotations

from typing import Any

from asyncgraph import Function, Variable

__all__ = ["Echo"]


class Echo(Function):
    """Identity whose backward runs on the fleet: a smoke test for a deployment.

    ``y = Echo.apply(x)``; ``await y.backward(executor=ex)`` round-trips through
    the workers and gives ``x.grad`` equal to the incoming gradient.
    """

    dispatch = "remote"
    remote_name = "workers.echo"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data, role=x.role)

    @staticmethod
    def backward(ctx: Any, grad: Variable | None) -> Variable | None:
        return grad
