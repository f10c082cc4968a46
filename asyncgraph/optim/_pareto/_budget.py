"""The budget of a search and the decisions it makes: pure functions of its limits and of
what the state says was spent.

A search stops when one limit is spent (``exhausted``); a round runs as many work items
as the budget left affords at the dearest item's cost so far (``affordable``); the
greedy tip is validated while the budget still pays for it (``tip_due``). Before any work
item has run, its cost is estimated from the seed's evaluation (``item_cost``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asyncgraph._exceptions import ModelConfigError
from asyncgraph.models import Usage

from ._outcome import Cost
from ._state import SearchState

__all__ = ["Budget", "item_cost"]


@dataclass(frozen=True)
class Budget:
    """The limits of a search (None: no limit of that kind); rounds count after the
    seed's evaluation, which is round 0."""

    max_calls: int | None
    max_tokens: int | None
    max_rounds: int | None
    max_cost_usd: float | None

    def exhausted(self, state: SearchState) -> bool:
        """True once a limit is spent."""
        return (
            (self.max_calls is not None and state.calls >= self.max_calls)
            or (self.max_tokens is not None and state.tokens >= self.max_tokens)
            or (self.max_rounds is not None and state.round > self.max_rounds)
            or (self.max_cost_usd is not None and state.cost_usd >= self.max_cost_usd)
        )

    def affordable(self, state: SearchState, wanted: int, item: Cost) -> int:
        """How many of ``wanted`` work items the budget left affords at ``item``'s cost
        (at least one: the budget was not spent when the round began)."""
        calls, tokens, dollars = item
        limit = wanted
        if self.max_calls is not None:
            limit = min(limit, (self.max_calls - state.calls) // max(1, calls))
        if self.max_tokens is not None:
            limit = min(limit, (self.max_tokens - state.tokens) // max(1, tokens))
        if self.max_cost_usd is not None and dollars > 0:
            limit = min(limit, math.floor((self.max_cost_usd - state.cost_usd) / dollars))
        return max(1, limit)

    def tip_due(self, state: SearchState, item: Cost, this_round: Cost | None = None) -> bool:
        """True when the greedy tip must be validated now: this is the last round of
        ``max_rounds``, or the budget left would not pay for one more work item (at
        ``item``'s cost) and the tip's validation (at the seed's). With ``this_round``
        (what the running round has spent so far), asked as at the round's end."""
        calls, tokens, dollars = this_round or (0, 0, 0.0)
        calls, tokens, dollars = (
            state.calls + calls,
            state.tokens + tokens,
            state.cost_usd + dollars,
        )
        round_ = state.round if this_round is None else state.round + 1
        if self.max_rounds is not None and round_ >= self.max_rounds:
            return True
        seed = _seed_row(state)
        need = (
            item[0] + int(seed["calls"]),
            item[1] + int(seed["tokens"]),
            item[2] + float(seed.get("cost_usd", 0.0)),
        )
        return (
            (self.max_calls is not None and self.max_calls - calls < need[0])
            or (self.max_tokens is not None and self.max_tokens - tokens < need[1])
            or (self.max_cost_usd is not None and self.max_cost_usd - dollars < need[2])
        )

    def check_priced(self, spent: Usage) -> None:
        """A cost cap needs every call priced: ``ModelConfigError`` if one of ``spent``
        was not."""
        if self.max_cost_usd is not None and spent.unpriced_requests:
            raise ModelConfigError(
                f"ParetoSearch: a model without a price answered {spent.unpriced_requests} "
                f"call(s), and a cost cap (max_cost_usd={self.max_cost_usd:g}) needs every "
                f"call priced: give the model a Pricing, or search without a cost cap",
                variable="pricing",
                value="None",
            )


def item_cost(
    state: SearchState, *, minibatch_size: int, pareto_size: int, parameters: int
) -> Cost:
    """What one work item costs, as far as the search knows: the dearest so far; before
    any has run, an estimate from the seed's evaluation (round 0): a proposal's forward,
    backward and evaluation on a minibatch, a rewrite per parameter, and its child's
    evaluation on the Pareto set, at the seed's cost an example."""
    if state.work_done:
        return state.dearest_item
    seed = _seed_row(state)
    seed_cost = float(seed.get("cost_usd", 0.0))
    examples = 3 * minibatch_size + pareto_size
    per_example = max(1, pareto_size)
    calls = math.ceil(seed["calls"] / per_example * examples) + parameters
    tokens = math.ceil(seed["tokens"] / per_example * examples) * 2
    return calls, tokens, seed_cost / per_example * examples * 2


def _seed_row(state: SearchState) -> dict[str, Any]:
    return state.history[0] if state.history else {"calls": 0, "tokens": 0}
