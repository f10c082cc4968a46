"""Exceptions raised by ``asyncgraph.optim``.

Hierarchy (``AsyncGraphError`` is the root of every asyncgraph error)::

    AsyncGraphError
    └── OptimizerError                   an optimizer step failed
        └── UpdateParseError             the model's reply held no improved value
                                         (also ValueError)

Misuse of the Python API (a parameter twice, a bad option, a state_dict that
does not match) raises the builtin ``TypeError`` / ``ValueError``; model
failures are ``asyncgraph.models.ModelError`` subclasses and propagate.
"""

from __future__ import annotations

from asyncgraph._exceptions import AsyncGraphError

__all__ = ["OptimizerError", "UpdateParseError"]


class OptimizerError(AsyncGraphError):
    """An optimizer step failed; no parameter was changed by that step."""


class UpdateParseError(OptimizerError, ValueError):
    """Every attempt's reply lacked the tags around the improved value.

    ``role`` is the parameter's role, ``attempts`` how many replies were tried,
    ``reply`` the last reply (in full; the message shows an excerpt).
    """

    def __init__(self, message: str, *, role: str, attempts: int, reply: str) -> None:
        super().__init__(message)
        self.role = role
        self.attempts = attempts
        self.reply = reply
