"""Exceptions raised by asyncgraph.

Hierarchy::

    AsyncGraphError
    ├── BackwardError (also RuntimeError)    one node's backward (or a hook) failed;
    │                                        names the Function and roles, chains the cause
    │   ├── RemoteError                      ... on a worker; carries the worker's traceback
    │   ├── RemoteConnectionError            Redis unreachable or lost while a node was
    │   │   (also ConnectionError)           remote: its result cannot arrive
    │   └── RemoteTimeoutError               no worker answered within the executor's
    │       (also TimeoutError)              timeout
    ├── GraphError (also RuntimeError)       misuse of the graph: freed graph, bad inputs,
    │                                        wrong gradient count
    ├── WireError (also ValueError)          a message failed validation (wire format)
    ├── ModelError                           a model call failed (asyncgraph.models, which
    │                                        draws its own subtree)
    └── CheckpointError                      a job checkpoint is missing, corrupt or
                                             another job's (asyncgraph.jobs)

Misuse of the Python API raises the builtin ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "AsyncGraphError",
    "BackwardError",
    "GraphError",
    "RemoteConnectionError",
    "RemoteError",
    "RemoteTimeoutError",
    "WireError",
]


class AsyncGraphError(Exception):
    """Base class of every asyncgraph error."""


class GraphError(AsyncGraphError, RuntimeError):
    """The graph cannot be differentiated as asked (freed graph, bad inputs, ...)."""


class BackwardError(AsyncGraphError, RuntimeError):
    """A node's backward failed; ``__cause__`` is the original exception.

    ``function`` is the Function's name, ``input_roles`` / ``output_roles`` the
    roles of the variables it connects.
    """

    def __init__(
        self,
        message: str,
        *,
        function: str = "",
        input_roles: tuple[str, ...] = (),
        output_roles: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.function = function
        self.input_roles = input_roles
        self.output_roles = output_roles


class RemoteError(BackwardError):
    """A backward that ran on a worker failed; ``remote_traceback`` is its text."""

    def __init__(self, message: str, *, remote_traceback: str = "", **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.remote_traceback = remote_traceback


class RemoteConnectionError(BackwardError, ConnectionError):
    """Redis could not be reached or went away while a node's backward was remote."""


class RemoteTimeoutError(BackwardError, TimeoutError):
    """No worker answered for a remote node within the executor's timeout."""


class WireError(AsyncGraphError, ValueError):
    """A message crossing a process boundary is malformed, too large or forged."""
