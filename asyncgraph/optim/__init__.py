"""Optimizers: update parameters from their gradients.

- :class:`TGD`: textual gradient descent; one model call per text parameter,
  all parameters at once, with constraints, feedback memory (``momentum``)
  and a guard that condenses feedback beyond ``max_feedback_tokens``.
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

from asyncgraph._exceptions import NoFeedbackWarning, OptimizerError, UpdateParseError
from asyncgraph.optim._optimizer import Optimizer
from asyncgraph.optim._pareto import Candidate, ParetoSearch, SearchResult
from asyncgraph.optim._sgd import SGD
from asyncgraph.optim._tgd import TGD

__all__ = [
    "Candidate",
    "NoFeedbackWarning",
    "Optimizer",
    "OptimizerError",
    "ParetoSearch",
    "SGD",
    "SearchResult",
    "TGD",
    "UpdateParseError",
]
