"""Optimizers: update parameters from their gradients.

- :class:`TGD`: textual gradient descent; one model call per text parameter,
  all parameters at once, with constraints, feedback memory (``momentum``)
  and a guard that condenses feedback beyond ``max_feedback_tokens``; updates
  come back as structured outputs where the model takes them, and an update
  that cannot be read is skipped (:class:`SkippedUpdate`) unless ``strict=True``.
- :class:`ParetoSearch`: reflective Pareto search over a Module's parameters
  (GEPA-style): a pool of candidates scored per example, parents from the Pareto
  frontier, children from the textual gradients of failing examples, merges,
  a budget in calls and tokens, every round's work at once, resumable state.
- :class:`SGD`: gradient descent for numeric parameters.
- :class:`Optimizer`: the base class (parameter groups, ``zero_grad()``,
  ``await step()``, JSON-ready ``state_dict()`` / ``load_state_dict()``).

Example::

    tgd = TGD([prompt], model="simulated", constraints=["At most two sentences."])
    for batch in batches:
        loss = await run(batch)
        await loss.backward()
        await tgd.step()
        tgd.zero_grad()
"""

from asyncgraph._exceptions import (
    NoFeedbackWarning,
    OptimizerError,
    ReplySkippedWarning,
    UpdateParseError,
)
from asyncgraph.optim._optimizer import Optimizer
from asyncgraph.optim._pareto import Candidate, ParetoSearch, SearchResult
from asyncgraph.optim._sgd import SGD
from asyncgraph.optim._tgd import TGD

# Not a public name: what tgd.skipped holds (documented with TGD).
from asyncgraph.optim._tgd import SkippedUpdate as SkippedUpdate  # isort: skip

__all__ = [
    "Candidate",
    "NoFeedbackWarning",
    "Optimizer",
    "OptimizerError",
    "ParetoSearch",
    "ReplySkippedWarning",
    "SGD",
    "SearchResult",
    "TGD",
    "UpdateParseError",
]
