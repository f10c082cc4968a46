"""What an observation belongs to: labels and the node a model call runs in."""

from __future__ import annotations

import contextvars
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from asyncgraph import Node, current_node

__all__ = ["PROCESS", "current_labels", "labels", "node_info"]

PROCESS = f"{socket.gethostname()}:{os.getpid()}"
"""This process as a timeline or call log names it (``host:pid``); workers are others."""

_LABELS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "asyncgraph_observe_labels", default=MappingProxyType({})
)


@contextmanager
def labels(**values: Any) -> Iterator[None]:
    """Attach ``values`` (JSON data) to every model call logged or traced inside the block.

    A contextvar: it applies to this task and the tasks it starts; blocks nest and an
    inner value wins. The job runner labels calls with their ``step`` and ``phase``::

        with labels(step=3, phase="validation"):
            await evaluate(...)
    """
    token = _LABELS.set({**_LABELS.get(), **values})
    try:
        yield
    finally:
        _LABELS.reset(token)


def current_labels() -> Mapping[str, Any]:
    """The labels of the enclosing ``labels`` blocks (empty outside them)."""
    return _LABELS.get()


def node_info(node: Node | None = None) -> dict[str, Any] | None:
    """``{"function", "inputs", "outputs", "seq"}`` of ``node`` (default: the running one)."""
    if node is None:
        node = current_node()
        if node is None:
            return None
    return {
        "function": node.name,
        "inputs": list(node.input_roles),
        "outputs": list(node.output_roles),
        "seq": list(node.seq),
    }
