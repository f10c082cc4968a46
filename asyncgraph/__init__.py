"""asyncgraph: reverse-mode autodiff for slow functions, asyncio- and trio-native.

``await loss.backward()`` turns every node's backward into an async task that
starts as soon as its inputs are ready, in-process or on a Redis-fed worker
fleet, and joins the gradients into the leaves exactly as a sequential run would.
"""

from ._core._accumulate import register_accumulator
from ._core._autodiff import backward, grad
from ._core._engine import NodeEvent, PassInfo, current_node, observe_nodes, observe_passes
from ._core._executor import Executor, use_executor
from ._core._function import Function, FunctionCtx, once_differentiable
from ._core._grad_manager import GradManager, GradManagerGroup
from ._core._grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from ._core._graph import Node, graph_order
from ._core._local_executor import LocalExecutor
from ._core._module import Module
from ._core._remote_forwards import remote_forwards
from ._core._variable import Parameter, Variable
from ._exceptions import (
    AsyncGraphError,
    BackwardError,
    GraphError,
    RemoteConnectionError,
    RemoteError,
    RemoteTimeoutError,
    WireError,
)

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
    "LocalExecutor",
    "Module",
    "Node",
    "NodeEvent",
    "Parameter",
    "PassInfo",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteTimeoutError",
    "Variable",
    "WireError",
    "backward",
    "current_node",
    "enable_grad",
    "grad",
    "graph_order",
    "is_grad_enabled",
    "no_grad",
    "observe_nodes",
    "observe_passes",
    "once_differentiable",
    "register_accumulator",
    "remote_forwards",
    "set_grad_enabled",
    "use_executor",
]
