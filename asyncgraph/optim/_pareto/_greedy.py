"""Greedy rounds: a chain of accepted children, validated once.

A greedy round drafts one proposal from the *tip* (the chain's last accepted child, not
validated yet) or, with no tip, from the best validated candidate; a child better on its
minibatch becomes the new tip, as in TGD each accepted step builds on the last. The tip
is scored on the Pareto set and joins the pool only when the chain stalls (``patience``
proposals in a row that did not improve) or when the budget is about to end
(``Budget.tip_due``), so a run of accepted rewrites costs one validation, not one each.
Greedy ends (the state's ``greedy`` turns False) when a validated tip is no better than
the candidate its chain began from, or when ``patience`` proposals in a row from the
best validated candidate fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from asyncgraph.models import track_usage
from asyncgraph.optim._frontier import Candidate

from ._outcome import Outcome
from ._round import Round
from ._state import values_key

__all__ = ["GreedyChain"]


@dataclass
class GreedyChain(Round):
    """The greedy rounds of a search: ``round`` runs one, ``validate_tip`` scores the tip."""

    patience: int

    async def round(self, rng: random.Random) -> Outcome:
        """One proposal from the tip (or the best validated candidate), its minibatch
        drawn by ``rng``; the tip is validated when the chain stalls or the budget is
        about to end."""
        state, tip = self.state, self.state.tip
        parent = state.by_id(tip["parent"]) if tip is not None else state.best
        outcome = Outcome("proposal", (parent.id,))
        if tip is not None and self.budget.tip_due(state, self.item):
            outcome.kind = "validation"
            return await self.validate_tip(outcome)
        with track_usage() as usage:
            await self._propose(parent, rng, outcome)
        outcome.charge(usage.snapshot())
        state.idle = 0 if outcome.improved else state.idle + 1
        if state.tip is not None and (
            state.idle >= self.patience or self.budget.tip_due(state, self.item, outcome.cost)
        ):
            return await self.validate_tip(outcome)
        if state.tip is None and state.idle >= self.patience:
            state.greedy = False
            outcome.note += "; greedy stalled: widening"
        state.tally([outcome])
        return outcome

    async def _propose(self, parent: Candidate, rng: random.Random, outcome: Outcome) -> None:
        """Draft a child of the tip (or of ``parent`` with no tip); one better on its
        minibatch becomes the tip, one step further from ``parent``."""
        tip = self.state.tip
        values = tip["values"] if tip is not None else parent.values
        draft = await self.drafter.draft(values, self.drafter.minibatch(rng), outcome)
        if draft is None:
            return
        if values_key(draft.child) in self.state.known():
            outcome.note = "duplicate of a candidate (not scored)"
        elif await self.drafter.better_on_minibatch(draft):
            steps = 1 + (tip["steps"] if tip is not None else 0)
            self.state.tip = {"values": draft.child, "parent": parent.id, "steps": steps}
            outcome.improved = True
            outcome.note = f"accepted as the tip ({steps} step(s) from {parent.id})"

    async def validate_tip(self, outcome: Outcome) -> Outcome:
        """Score the tip on the Pareto set and add it to the pool; widen if the chain did
        not beat the candidate it began from."""
        state, tip = self.state, self.state.tip
        assert tip is not None
        state.tip, state.idle = None, 0
        parent = state.by_id(tip["parent"])
        with track_usage() as usage:
            scores = await self.evaluator.pareto_scores(tip["values"])
        outcome.charge(usage.snapshot())
        outcome.stages.append("validation")
        cid = state.add(tip["values"], (parent.id,), "proposal", scores)
        outcome.note += ("; " if outcome.note else "") + f"tip validated, kept as {cid}"
        if sum(scores) <= sum(parent.scores):
            state.greedy = False
            outcome.note += " (no better than its chain's start: widening)"
        state.tally([outcome])
        return outcome
