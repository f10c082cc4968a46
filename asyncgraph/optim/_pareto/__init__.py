"""``ParetoSearch``: reflective evolutionary search over a Module's parameters (GEPA-style).

A pool of candidates (values of every parameter), each scored per example on a fixed
validation sample (the Pareto set). Parents are drawn from the Pareto frontier of those
per-example scores, so a candidate that is best on even one example survives; children
come from the textual gradients of the parent's failing training examples (forward,
loss, ``await backward()``, then TGD's rewrite from ``.grad``); candidates that are best
on disjoint example sets are merged. It starts greedy (one proposal a round, from the
last accepted child, validated only when the chain stalls) and widens to rounds of
several proposals and merges once greedy steps stop paying. Work is done in rounds: the
items of a round run at once (every model call bounded by ``max_concurrency``), children
equal to a known candidate or to an earlier sibling are dropped before any validation,
and the round's outcomes join the pool in plan order, so a seed and a deterministic model
give one result however the tasks interleave, and a search resumed from ``state_dict()``
between rounds ends exactly where an uninterrupted one does.

One concept a module, as GEPA splits its engine: ``_search`` the loop (``ParetoSearch``:
``step``, ``run``, the checkpoint), ``_options`` what it accepts, ``_state`` the state it
checkpoints (the pool, the spending, the history, the greedy chain; its format; the
``SearchResult`` made from it), ``_budget`` the limits and what they decide (when to
stop, how many items a round affords, when the tip is due), ``_greedy`` and ``_wide``
the two kinds of round, ``_drafting`` a proposal's rewrite (the reflective mutation),
``_merging`` a merge of two candidates, ``_validation`` running candidates and scoring
children on the Pareto set in stages, ``_outcome`` the record of one work item. The
Pareto arithmetic is the pure functions of ``asyncgraph/optim/_frontier.py``. Imports go
from the loop down: the rounds use the parts, the parts use the state and the outcome,
none imports the loop.
"""

from asyncgraph.optim._frontier import Candidate

from ._search import ParetoSearch
from ._state import SearchResult

__all__ = ["Candidate", "ParetoSearch", "SearchResult"]
