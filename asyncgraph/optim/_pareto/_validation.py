"""Running candidates on examples, and scoring children on the Pareto set in stages.

``Evaluator.run`` runs a copy of the searched Module holding one candidate's values (a
*program*) on examples, at most the limiter's capacity of forwards at once, each in its
``graph_order``: gradients meeting in a parameter sum in example order, however the
forwards interleave. ``Evaluator.scores`` scores a candidate on positions of the Pareto
set, without recording a graph (``pareto_scores``: on all of it).

A child is scored in two stages, so that a bad one is stopped before it costs the whole
Pareto set: a proposal's child on a seeded quarter first, then on the rest if it is at
least as good as its parent on that quarter (``validate_child``); a merge on the examples
its parents win first, then on the rest if it is at least as good as both there
(``validate_merge``). A child that passes both stages gets its ``child`` and ``scores``
set in its outcome; one that fails gets a note.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from asyncgraph import Module, Variable, graph_order, no_grad
from asyncgraph.optim._frontier import Candidate
from asyncgraph.text import run_all

from ._outcome import Outcome

__all__ = ["Evaluator", "Forward", "call_program"]

Forward = Callable[[Module, Mapping[str, Any]], Awaitable[Any]]
"""``forward(program, example)``: run ``program`` (a copy of the searched Module holding one
candidate's values) on one example; returns an object with ``.loss`` (a Variable) and
``.score`` (a number in [0, 1]), such as ``asyncgraph.jobs.Evaluation``, or a
``(loss, score)`` pair."""


async def call_program(program: Module, example: Mapping[str, Any]) -> Any:
    """The default ``forward``: ``program(example)``."""
    return await program(example)


def _unpack(result: Any) -> tuple[Variable, float]:
    if isinstance(result, tuple) and len(result) == 2:
        loss, score = result
    else:
        loss, score = getattr(result, "loss", None), getattr(result, "score", None)
    if not isinstance(loss, Variable) or isinstance(score, bool):
        raise TypeError(
            f"ParetoSearch: forward must return an object with .loss (a Variable) and .score "
            f"(a number), such as asyncgraph.jobs.Evaluation, or a (loss, score) pair; got "
            f"{result!r:.80}"
        )
    try:
        return loss, float(score)
    except (TypeError, ValueError):
        raise TypeError(f"ParetoSearch: a score must be a number, got {score!r:.60}") from None


@dataclass
class Evaluator:
    """Runs candidates of ``module`` with ``forward``, at most ``limiter``'s capacity of
    forwards at once; the Pareto set is the examples of ``val_set`` at
    ``pareto_indices``."""

    module: Module
    forward: Forward
    val_set: Sequence[Mapping[str, Any]]
    pareto_indices: Sequence[int]
    limiter: anyio.CapacityLimiter

    def program(self, values: Mapping[str, Any]) -> Module:
        """A copy of the Module holding ``values`` (fresh Parameters: copies run at once)."""
        program = self.module.clone()
        program.load_state_dict(values)
        return program

    async def run(
        self, program: Module, examples: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Variable, float]]:
        """``(loss, score)`` of ``program`` on each example, in example order."""
        results: list[tuple[Variable, float] | None] = [None] * len(examples)

        async def one(i: int) -> None:
            async with self.limiter:
                with graph_order(i):  # gradients meeting in a parameter sum in batch order
                    results[i] = _unpack(await self.forward(program, examples[i]))

        await run_all([functools.partial(one, i) for i in range(len(examples))])
        return [r for r in results if r is not None]

    async def scores(self, values: Mapping[str, Any], positions: Sequence[int]) -> list[float]:
        """Scores of a candidate on ``positions`` of the Pareto set (no graph recorded)."""
        if not positions:
            return []
        examples = [self.val_set[self.pareto_indices[j]] for j in positions]
        with no_grad():
            results = await self.run(self.program(values), examples)
        return [score for _, score in results]

    async def pareto_scores(self, values: Mapping[str, Any]) -> list[float]:
        """Scores of a candidate on the whole Pareto set."""
        return await self.scores(values, range(len(self.pareto_indices)))

    async def validate_child(
        self, child: dict[str, Any], parent: Candidate, rng: random.Random, outcome: Outcome
    ) -> None:
        """A proposal's child: on a quarter of the Pareto set drawn by ``rng``, then (at
        least as good as ``parent`` there) on the rest."""
        n = len(self.pareto_indices)
        sample = sorted(rng.sample(range(n), max(1, n // 4)))
        first = await self.scores(child, sample)
        outcome.stages.append("validation (sample)")
        got, need = sum(first), sum(parent.scores[j] for j in sample)
        if got < need:
            outcome.note = (
                f"worse than its parent on a sample of the Pareto set ({got:g} < {need:g})"
            )
            return
        await self._rest(child, sample, first, outcome)

    async def validate_merge(
        self, merged: dict[str, Any], a: Candidate, b: Candidate, won: set[int], outcome: Outcome
    ) -> None:
        """A merge of ``a`` and ``b``: on the positions they win (``won``), then (at least
        as good as both there) on the rest."""
        shared = sorted(won)
        first = await self.scores(merged, shared)
        outcome.stages.append("validation (won examples)")
        got = sum(first)
        need = max(sum(a.scores[j] for j in shared), sum(b.scores[j] for j in shared))
        if got < need:
            outcome.note = f"worse than a parent where they win ({got:g} < {need:g})"
            return
        await self._rest(merged, shared, first, outcome)

    async def _rest(
        self, child: dict[str, Any], done: list[int], done_scores: list[float], outcome: Outcome
    ) -> None:
        """The second stage: the positions not in ``done``; the child and its scores (one
        per position of the Pareto set) go into ``outcome``."""
        rest = [j for j in range(len(self.pareto_indices)) if j not in set(done)]
        rest_scores = await self.scores(child, rest)
        outcome.stages.append("validation (rest)")
        scores = [0.0] * len(self.pareto_indices)
        for j, s in [*zip(done, done_scores, strict=True), *zip(rest, rest_scores, strict=True)]:
            scores[j] = s
        outcome.child, outcome.scores = child, scores
