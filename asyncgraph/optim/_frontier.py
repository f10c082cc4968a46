"""The Pareto arithmetic of ``ParetoSearch``: pure functions of the candidates.

Each candidate has one score per example of the Pareto set. A candidate *wins* an
example when it has the best score on it (above 0); the frontier is the candidates that
win at least one example and that no other candidate dominates (at least as good
everywhere, better somewhere).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Candidate",
    "ancestors",
    "best_candidate",
    "by_id",
    "merge_pairs",
    "pareto_frontier",
    "wins",
]


@dataclass
class Candidate:
    """One point of the search: ``values`` (the Module's ``state_dict()``), where it came
    from (``origin``: ``"seed"``, ``"proposal"`` or ``"merge"``; ``parents`` ids; the
    ``round`` that made it) and its ``scores``, one per example of the Pareto set.

    Example::

        result = await ParetoSearch(program, train, val, model="simulated").run()
        best = result.best                  # a Candidate
        print(best.id, best.origin, best.round, best.mean, best.values)
    """

    id: int
    values: dict[str, Any]
    parents: tuple[int, ...]
    origin: str
    round: int
    scores: list[float]

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    def to_data(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "values": copy.deepcopy(self.values),
            "parents": list(self.parents),
            "origin": self.origin,
            "round": self.round,
            "scores": list(self.scores),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Candidate:
        return cls(
            id=int(data["id"]),
            values=copy.deepcopy(dict(data["values"])),
            parents=tuple(int(p) for p in data["parents"]),
            origin=str(data["origin"]),
            round=int(data["round"]),
            scores=[float(s) for s in data["scores"]],
        )


def wins(pool: Sequence[Candidate]) -> dict[int, set[int]]:
    """Candidate id -> the Pareto-set positions where it has the best score (> 0)."""
    won: dict[int, set[int]] = {c.id: set() for c in pool}
    for j in range(len(pool[0].scores) if pool else 0):
        best = max(c.scores[j] for c in pool)
        if best <= 0:
            continue
        for c in pool:
            if c.scores[j] == best:
                won[c.id].add(j)
    return won


def best_candidate(pool: Sequence[Candidate]) -> Candidate:
    """The highest mean score (the oldest on a tie); ``pool`` must not be empty."""
    return max(pool, key=lambda c: (c.mean, -c.id))


def pareto_frontier(pool: Sequence[Candidate], max_frontier: int) -> list[tuple[Candidate, int]]:
    """Every candidate that wins an example and is dominated by none, with how many it
    wins, in id order; at most ``max_frontier`` (the widest coverage, then the best mean,
    then the oldest), one per distinct score vector (the oldest). Before any example is
    won, the best candidate alone. ``pool`` must not be empty."""
    won = wins(pool)
    on = [c for c in pool if won[c.id]]

    def dominated(c: Candidate) -> bool:
        return any(
            d is not c
            and all(x >= y for x, y in zip(d.scores, c.scores, strict=True))
            and d.scores != c.scores
            for d in on
        )

    kept = [c for c in on if not dominated(c)]
    unique: dict[tuple[float, ...], Candidate] = {}
    for c in kept:
        unique.setdefault(tuple(c.scores), c)
    kept = sorted(unique.values(), key=lambda c: (-len(won[c.id]), -c.mean, c.id))
    kept = kept[:max_frontier]
    if not kept:
        return [(best_candidate(pool), 1)]
    return [(c, len(won[c.id])) for c in sorted(kept, key=lambda c: c.id)]


def by_id(pool: Sequence[Candidate], cid: int) -> Candidate:
    return next(c for c in pool if c.id == cid)


def ancestors(pool: Sequence[Candidate], cid: int) -> set[int]:
    """``cid`` and every candidate it descends from."""
    seen: set[int] = set()
    stack = [cid]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(by_id(pool, current).parents)
    return seen


def merge_pairs(
    pool: Sequence[Candidate],
    frontier: Sequence[tuple[Candidate, int]],
    merged: set[tuple[int, int]] | frozenset[tuple[int, int]],
) -> list[tuple[int, int]]:
    """Frontier pairs, not ``merged`` yet, each winning where the other does not; the
    widest joint coverage first."""
    won = wins(pool)
    pairs: list[tuple[int, int, int]] = []
    ids = [c.id for c, _ in frontier]
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            if (a, b) in merged or not (won[a] - won[b] and won[b] - won[a]):
                continue
            pairs.append((-len(won[a] | won[b]), a, b))
    return [(a, b) for _, a, b in sorted(pairs)]
