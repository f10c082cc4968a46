"""Wide rounds: proposals from the frontier and merges of its pairs, all at once.

A wide round plans its work items from a generator seeded by (seed, round): up to
``merges`` merges of frontier pairs that each win examples the other does not (each pair
once), and ``proposals`` proposals from parents drawn from the frontier, weighted by the
number of examples each is best on, each with a minibatch; as many as the budget left
affords (``Budget.affordable``). The items run in two phases, each all at once: first
what each child is (the rewrites and the merges), then, once every child of the round is
known, the scores of the children that are new: one equal to a candidate of the pool or
to an earlier item's child (in plan order) is dropped before it costs a forward. The
children that pass their validation join the pool in plan order, so the pool does not
depend on how the tasks interleave.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncgraph.models import track_usage
from asyncgraph.optim._frontier import merge_pairs, wins
from asyncgraph.text import run_all

from ._drafting import Draft
from ._merging import Merger
from ._outcome import Outcome
from ._round import Round
from ._state import values_key

__all__ = ["WideRound"]


@dataclass
class _Item:
    """One work item of a wide round: its outcome (kind and parents), a proposal's
    minibatch, and what its first phase made (a proposal's draft, a merge's values)."""

    outcome: Outcome
    batch: list[int] = field(default_factory=list)
    made: Draft | dict[str, Any] | None = None


@dataclass
class WideRound(Round):
    """One wide round of a search (``run``); ``seed`` seeds its draws."""

    merger: Merger
    proposals: int
    merges: int
    max_frontier: int
    seed: int

    def plan(self, rng: random.Random) -> list[_Item]:
        """The round's work items, drawn by ``rng``: the merges first, then the proposals,
        cut to what the budget affords."""
        state = self.state
        frontier = state.frontier(self.max_frontier)
        pairs = merge_pairs(state.pool, frontier, state.merged_pairs)[: self.merges]
        items = [_Item(Outcome("merge", pair)) for pair in pairs]
        for _ in range(self.proposals):
            (parent,) = rng.choices([c for c, _ in frontier], weights=[w for _, w in frontier])
            items.append(_Item(Outcome("proposal", (parent.id,)), self.drafter.minibatch(rng)))
        return items[: self.budget.affordable(state, len(items), self.item)]

    async def run(self, rng: random.Random) -> list[Outcome]:
        """Plan the round with ``rng``, run it, and add the children it keeps to the pool;
        the outcomes in plan order."""
        items = self.plan(rng)
        await self._each(self._make, items)
        self._drop_duplicates(items)
        await self._each(self._score, items)
        outcomes = [item.outcome for item in items]
        self.state.tally(outcomes)
        for outcome in outcomes:  # in plan order: the pool does not depend on timing
            if outcome.kind == "merge":
                a, b = outcome.parents
                self.state.merged_pairs.add((min(a, b), max(a, b)))
            if outcome.child is None or outcome.scores is None:
                continue
            cid = self.state.add(outcome.child, outcome.parents, outcome.kind, outcome.scores)
            outcome.note = f"kept as {cid}"
        return outcomes

    async def merge(self, a_id: int, b_id: int) -> Outcome:
        """One merge of candidates ``a_id`` and ``b_id``, scored (the child or a note)."""
        a, b = self.state.by_id(a_id), self.state.by_id(b_id)
        outcome = Outcome("merge", (a_id, b_id))
        merged = await self.merger.child(self.state.pool, a, b, outcome)
        if merged is not None:
            await self._validate_merge(merged, outcome)
        return outcome

    async def _each(
        self, phase: Callable[[int, _Item], Awaitable[None]], items: list[_Item]
    ) -> None:
        """Run ``phase`` on every item at once, each item's spending added to its cost
        (the round's meter counts it too: the meters nest)."""

        async def metered(index: int) -> None:
            with track_usage() as usage:
                await phase(index, items[index])
            items[index].outcome.charge(usage.snapshot())

        await run_all([functools.partial(metered, i) for i in range(len(items))])

    async def _make(self, index: int, item: _Item) -> None:
        """The first phase: a proposal's rewrite or a merge's values."""
        outcome = item.outcome
        if outcome.kind == "merge":
            a, b = (self.state.by_id(p) for p in outcome.parents)
            item.made = await self.merger.child(self.state.pool, a, b, outcome)
        else:
            parent = self.state.by_id(outcome.parents[0])
            item.made = await self.drafter.draft(parent.values, item.batch, outcome)

    def _drop_duplicates(self, items: list[_Item]) -> None:
        """Drop each child equal to a candidate or to an earlier item's child."""
        known = self.state.known()
        for item in items:  # in plan order: the same survivors every time
            if item.made is None:
                continue
            made = item.made
            key = values_key(made.child if isinstance(made, Draft) else made)
            if key in known:
                item.outcome.note = "duplicate (not scored)"
                item.made = None
            known.add(key)

    async def _score(self, index: int, item: _Item) -> None:
        """The second phase: a proposal's child on its minibatch, then on the Pareto set
        (a seeded quarter first); a merge on the Pareto set."""
        made, outcome = item.made, item.outcome
        if isinstance(made, Draft):
            if await self.drafter.better_on_minibatch(made):
                parent = self.state.by_id(outcome.parents[0])
                rng = random.Random(f"{self.seed}:sample:{self.state.round}:{index}")
                await self.evaluator.validate_child(made.child, parent, rng, outcome)
        elif made is not None:
            await self._validate_merge(made, outcome)

    async def _validate_merge(self, merged: dict[str, Any], outcome: Outcome) -> None:
        a, b = (self.state.by_id(p) for p in outcome.parents)
        won = wins(self.state.pool)
        await self.evaluator.validate_merge(merged, a, b, won[a.id] | won[b.id], outcome)
