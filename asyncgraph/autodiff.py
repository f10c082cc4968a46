"""The autodiff pieces of asyncgraph, importable on their own.

Everything here is also exported from ``asyncgraph``.
"""

from asyncgraph import (
    BackwardError,
    Function,
    FunctionCtx,
    GradManager,
    GradManagerGroup,
    GraphError,
    Node,
    NodeEvent,
    Parameter,
    RemovableHandle,
    Variable,
    accumulate,
    backward,
    enable_grad,
    grad,
    graph_order,
    is_grad_enabled,
    no_grad,
    register_accumulator,
    set_grad_enabled,
)
from asyncgraph.executors import Executor, LocalExecutor, current_executor, use_executor

__all__ = [
    "BackwardError",
    "Executor",
    "Function",
    "FunctionCtx",
    "GradManager",
    "GradManagerGroup",
    "GraphError",
    "LocalExecutor",
    "Node",
    "NodeEvent",
    "Parameter",
    "RemovableHandle",
    "Variable",
    "accumulate",
    "backward",
    "current_executor",
    "enable_grad",
    "grad",
    "graph_order",
    "is_grad_enabled",
    "no_grad",
    "register_accumulator",
    "set_grad_enabled",
    "use_executor",
]
