"""What every round works with: the search's state, its budget, and the parts that run
candidates and draft children. ``GreedyChain`` and ``WideRound`` are the two kinds."""

from __future__ import annotations

from dataclasses import dataclass

from ._budget import Budget
from ._drafting import Drafter
from ._outcome import Cost
from ._state import SearchState
from ._validation import Evaluator

__all__ = ["Round"]


@dataclass
class Round:
    """The parts of one round: the search's ``state`` (which the round grows), its
    ``budget`` with a work item's cost as the budget counts it (``item``, from
    ``item_cost``), the ``evaluator`` that runs candidates and the ``drafter`` that
    drafts proposals; each is built for the round when it starts."""

    state: SearchState
    budget: Budget
    item: Cost
    evaluator: Evaluator
    drafter: Drafter
