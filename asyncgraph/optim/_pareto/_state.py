"""The state of a search: everything ``ParetoSearch.state_dict()`` saves, in one object.

``SearchState`` holds the pool of candidates (the Pareto arithmetic over it is the pure
functions of ``asyncgraph/optim/_frontier.py``), the round, what was spent, the merged
pairs, the history (one row a round) and the greedy chain (``greedy``, ``tip``,
``idle``); ``StateField`` shows each field as an attribute of the search, and
``SearchResult`` is what the state says when the search ends. The checkpoint's format is
written here and nowhere else: ``checkpoint`` makes the JSON data, ``restore`` checks it
against the search it is loaded into and reads it back whole, or raises ``ValueError``
and changes nothing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, overload

from asyncgraph.models import Usage
from asyncgraph.optim._frontier import Candidate, best_candidate, by_id, pareto_frontier

from ._outcome import Cost, Outcome

__all__ = [
    "FORMAT",
    "VERSION",
    "SearchResult",
    "SearchState",
    "StateField",
    "checkpoint",
    "restore",
    "values_key",
]

FORMAT = "asyncgraph-pareto-search"
VERSION = 2


def values_key(values: Mapping[str, Any]) -> str:
    """A candidate's values as one comparable string (children equal to a candidate are
    dropped by it)."""
    return json.dumps(values, sort_keys=True)


def _no_candidates() -> RuntimeError:
    return RuntimeError("ParetoSearch has no candidates yet: run it first")


@dataclass
class SearchResult:
    """How a search ended: the best candidate (loaded into the Module), the model calls,
    tokens and US dollars it spent, and one row per round in ``history``.

    Example::

        result = await ParetoSearch(program, train, val, model="simulated", max_calls=500).run()
        print(result.best_score, result.rounds, result.calls, result.cost_usd)
    """

    best: Candidate
    rounds: int
    calls: int
    tokens: int
    pool_size: int
    frontier: list[int]
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    cost_usd: float = 0.0

    @property
    def best_score(self) -> float:
        return self.best.mean


@dataclass
class SearchState:
    """A search between two rounds: the ``pool`` of candidates; the next ``round``'s
    number; what was spent (``calls``, ``tokens``, ``cost_usd``) in ``work_done`` work
    items, the ``dearest_item`` of them in each of the three; the ``merged_pairs``; the
    ``history``, one row a round; and the greedy chain: whether rounds are still
    ``greedy``, its ``tip`` (the last accepted child, not validated yet: its ``values``,
    the ``parent`` the chain began from and its ``steps``) and how many proposals in a
    row did not improve (``idle``). ``ParetoSearch`` shows each field as an attribute of
    its own (``StateField``)."""

    pool: list[Candidate] = field(default_factory=list)
    round: int = 0
    calls: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    work_done: int = 0
    dearest_item: Cost = (0, 0, 0.0)
    merged_pairs: set[tuple[int, int]] = field(default_factory=set)
    history: list[dict[str, Any]] = field(default_factory=list)
    greedy: bool = True
    tip: dict[str, Any] | None = None
    idle: int = 0

    # -- the pool ---------------------------------------------------------------------
    @property
    def best(self) -> Candidate:
        if not self.pool:
            raise _no_candidates()
        return best_candidate(self.pool)

    def frontier(self, max_frontier: int) -> list[tuple[Candidate, int]]:
        if not self.pool:
            raise _no_candidates()
        return pareto_frontier(self.pool, max_frontier)

    def by_id(self, cid: int) -> Candidate:
        return by_id(self.pool, cid)

    def known(self) -> set[str]:
        """The ``values_key`` of every candidate."""
        return {values_key(c.values) for c in self.pool}

    def add(
        self, values: dict[str, Any], parents: tuple[int, ...], origin: str, scores: list[float]
    ) -> int:
        """Add a validated child to the pool, made this round; its id."""
        cid = max(c.id for c in self.pool) + 1
        self.pool.append(Candidate(cid, values, parents, origin, self.round, scores))
        return cid

    # -- spending and history ----------------------------------------------------------
    def spend(self, spent: Usage) -> None:
        """Count a round's spending (a ``track_usage`` snapshot)."""
        self.calls += spent.requests
        self.tokens += spent.total_tokens
        self.cost_usd += spent.cost_usd

    def tally(self, done: Sequence[Outcome]) -> None:
        """Count work items that ran, and the dearest of them."""
        self.work_done += len(done)
        self.dearest_item = (
            max([self.dearest_item[0], *(o.cost[0] for o in done)]),
            max([self.dearest_item[1], *(o.cost[1] for o in done)]),
            max([self.dearest_item[2], *(o.cost[2] for o in done)]),
        )

    def row(self, outcomes: Sequence[Outcome], max_frontier: int) -> dict[str, Any]:
        """The history's row for the round that just ran (before ``round`` moves on)."""
        best = self.best
        return {
            "round": self.round,
            "work": [o.to_row() for o in outcomes],
            "pool": len(self.pool),
            "greedy": self.greedy,
            "tip_steps": 0 if self.tip is None else self.tip["steps"],
            "frontier": [c.id for c, _ in self.frontier(max_frontier)],
            "best_id": best.id,
            "best_score": best.mean,
            "calls": self.calls,
            "tokens": self.tokens,
            "cost_usd": self.cost_usd,
        }

    def result(self, max_frontier: int, wall_s: float) -> SearchResult:
        """How the search stands: its best candidate, its spending, its history."""
        return SearchResult(
            best=self.best,
            rounds=self.round,
            calls=self.calls,
            tokens=self.tokens,
            pool_size=len(self.pool),
            frontier=[c.id for c, _ in self.frontier(max_frontier)],
            history=copy.deepcopy(self.history),
            wall_s=wall_s,
            cost_usd=self.cost_usd,
        )


class _HasState(Protocol):
    state: SearchState


T = TypeVar("T")


class StateField(Generic[T]):
    """A field of the state shown as an attribute of the object holding it, read and
    written there: ``search.pool`` is ``search.state.pool`` (a loaded state replaces
    ``search.state`` whole)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, holder: None, owner: type) -> StateField[T]: ...
    @overload
    def __get__(self, holder: _HasState, owner: type) -> T: ...
    def __get__(self, holder: _HasState | None, owner: type) -> T | StateField[T]:
        if holder is None:
            return self
        value: T = getattr(holder.state, self.name)
        return value

    def __set__(self, holder: _HasState, value: T) -> None:
        setattr(holder.state, self.name, value)


def checkpoint(state: SearchState, identity: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as JSON data, marked with the ``identity`` of the search it belongs to."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "identity": dict(identity),
        "round": state.round,
        "calls": state.calls,
        "tokens": state.tokens,
        "work_done": state.work_done,
        "cost_usd": state.cost_usd,
        "dearest_item": list(state.dearest_item),
        "pool": [c.to_data() for c in state.pool],
        "merged_pairs": sorted([a, b] for a, b in state.merged_pairs),
        "history": copy.deepcopy(state.history),
        "greedy": state.greedy,
        "tip": copy.deepcopy(state.tip),
        "idle": state.idle,
    }


def restore(data: Mapping[str, Any], identity: Mapping[str, Any], pareto_size: int) -> SearchState:
    """The state ``checkpoint`` saved (also after a JSON round trip); ``ValueError`` if
    ``data`` is not one, or was saved by a search of another ``identity``, or is corrupt
    (a candidate without one score per example of the Pareto set: ``pareto_size``)."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ValueError("ParetoSearch.load_state_dict expects ParetoSearch.state_dict()")
    if data.get("version") != VERSION:
        raise ValueError(f"ParetoSearch state version {data.get('version')!r} unknown")
    expected = json.loads(json.dumps(identity))
    if data.get("identity") != expected:
        raise ValueError(
            f"this ParetoSearch state belongs to another search: {data.get('identity')!r:.200}"
            f" was saved, this one is {expected!r:.200}"
        )
    try:
        state = _read(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"ParetoSearch state is corrupt: {exc!r}") from None
    for c in state.pool:
        if len(c.scores) != pareto_size:
            raise ValueError(f"ParetoSearch state is corrupt: candidate {c.id}'s scores")
    return state


def _read(data: Mapping[str, Any]) -> SearchState:
    pool = [Candidate.from_data(c) for c in data["pool"]]
    merged = {(int(a), int(b)) for a, b in data["merged_pairs"]}
    round_, calls, tokens, work_done = (
        int(data[k]) for k in ("round", "calls", "tokens", "work_done")
    )
    history = [dict(row) for row in data["history"]]
    dearest = [*data.get("dearest_item", ()), 0, 0, 0.0][:3]
    dearest_item = (int(dearest[0]), int(dearest[1]), float(dearest[2]))
    cost_usd = float(data.get("cost_usd", 0.0))
    greedy, idle = bool(data["greedy"]), int(data["idle"])
    tip = data["tip"]
    if tip is not None:
        tip = {
            "values": copy.deepcopy(dict(tip["values"])),
            "parent": int(tip["parent"]),
            "steps": int(tip["steps"]),
        }
    return SearchState(
        pool=pool,
        round=round_,
        calls=calls,
        tokens=tokens,
        cost_usd=cost_usd,
        work_done=work_done,
        dearest_item=dearest_item,
        merged_pairs=merged,
        history=history,
        greedy=greedy,
        tip=tip,
        idle=idle,
    )
