"""asyncgraph: reverse-mode autodiff for slow functions, asyncio- and trio-native.

``await loss.backward()`` turns every node's backward into an async task that
starts as soon as its inputs are ready, in-process or on a Redis-fed worker
fleet, and joins the gradients into the leaves exactly as a sequential run would.
"""

from asyncgraph.executors import Executor, LocalExecutor, current_executor, use_executor

from ._accumulate import accumulate, register_accumulator
from ._autodiff import backward, grad
from ._engine import NodeEvent, PassInfo, current_node, observe_nodes, observe_passes
from ._exceptions import (
    AsyncGraphError,
    BackwardError,
    GraphError,
    RemoteConnectionError,
    RemoteError,
    RemoteTimeoutError,
    WireError,
)
from ._function import Function, FunctionCtx
from ._grad_manager import GradManager, GradManagerGroup
from ._grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ._graph import Node, RemovableHandle, graph_order
from ._module import IncompatibleKeys, Module
from ._variable import Parameter, Variable

__version__ = "0.1.0"

__all__ = [
    "AsyncGraphError",
    "BackwardError",
    "Executor",
    "Function",
    "FunctionCtx",
    "GradManager",
    "GradManagerGroup",
    "GraphError",
    "IncompatibleKeys",
    "LocalExecutor",
    "Module",
    "Node",
    "NodeEvent",
    "PassInfo",
    "Parameter",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteTimeoutError",
    "RemovableHandle",
    "Variable",
    "WireError",
    "accumulate",
    "backward",
    "current_executor",
    "current_node",
    "enable_grad",
    "grad",
    "graph_order",
    "is_grad_enabled",
    "no_grad",
    "observe_nodes",
    "observe_passes",
    "register_accumulator",
    "set_grad_enabled",
    "use_executor",
]
