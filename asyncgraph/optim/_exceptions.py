"""Exceptions raised by ``asyncgraph.optim``.

Hierarchy (``AsyncGraphError`` is the root of every asyncgraph error)::

    AsyncGraphError
    └── OptimizerError                   an optimizer step failed
        └── UpdateParseError             the model's reply held no improved value
                                         (also ValueError)

    UserWarning
    └── NoFeedbackWarning                a parameter got no gradient before a step

Misuse of the Python API (a parameter twice, a bad option, a state_dict that
does not match) raises the builtin ``TypeError`` / ``ValueError``; model
failures are ``asyncgraph.models.ModelError`` subclasses and propagate.
"""

from __future__ import annotations

from asyncgraph import AsyncGraphError

__all__ = ["NoFeedbackWarning", "OptimizerError", "UpdateParseError"]


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


class NoFeedbackWarning(UserWarning):
    """A parameter given to an optimizer received no gradient in the last backward.

    Warned by ``step()``, once per such parameter per step (parameters with
    ``requires_grad=False`` excepted): the parameter is not updated. Usually it
    is not part of the graph of the loss (not passed to the calls, created under
    ``no_grad()``), or ``zero_grad()`` ran between ``backward`` and ``step``. A
    step where nothing needed fixing (e.g. a ``DeterministicEvaluator`` found
    every prediction right) warns too; silence it with
    ``warnings.simplefilter("ignore", NoFeedbackWarning)``.
    """
