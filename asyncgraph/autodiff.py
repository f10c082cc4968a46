"""The autodiff pieces of asyncgraph, importable on their own.

Everything here is also exported from ``asyncgraph``.
"""

from asyncgraph.executors import Executor, LocalExecutor, current_executor, use_executor

from ._accumulate import accumulate, register_accumulator
from ._autodiff import backward, grad
from ._engine import NodeEvent
from ._exceptions import BackwardError, GraphError
from ._function import Function, FunctionCtx
from ._grad_manager import GradManager, GradManagerGroup
from ._grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ._graph import Node, RemovableHandle, graph_order
from ._variable import Parameter, Variable

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
