"""Exceptions raised by ``asyncgraph.text``.

Hierarchy (``AsyncGraphError`` is the root of every asyncgraph error)::

    AsyncGraphError
    ├── UnknownModelError (also LookupError)   a model spec names no model in this process
    └── StructuredOutputError (also ValueError) a reply never followed its response_format
        (defined in ``asyncgraph.text._structured``)

Misuse of the Python API (a missing template field, a Variable passed as an
option) raises the builtin ``TypeError`` / ``ValueError``; model failures are
``asyncgraph.models.ModelError`` subclasses, wrapped by the engine in a
``BackwardError`` naming the node when they happen during backward.
"""

from __future__ import annotations

from asyncgraph import AsyncGraphError

__all__ = ["UnknownModelError"]


class UnknownModelError(AsyncGraphError, LookupError):
    """``resolve_model(spec)`` found no registered model and could not build one.

    ``spec`` is the name asked for, ``base_url`` the server it was asked with.
    """

    def __init__(self, message: str, *, spec: str, base_url: str | None = None) -> None:
        super().__init__(message)
        self.spec = spec
        self.base_url = base_url
