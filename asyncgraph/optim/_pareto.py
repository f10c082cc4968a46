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
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncgraph import (
    Executor,
    Module,
    Variable,
    backward,
    enable_grad,
    graph_order,
    no_grad,
)
from asyncgraph._exceptions import ModelConfigError, NoFeedbackWarning, UpdateParseError
from asyncgraph.models import BaseChatModel, ChatModel, limit_calls, reply_tokens, track_usage
from asyncgraph.optim._frontier import (
    Candidate,
    ancestors,
    best_candidate,
    by_id,
    merge_pairs,
    pareto_frontier,
    wins,
)
from asyncgraph.optim._prompts import ValueForm, merge_messages
from asyncgraph.optim._tgd import DEFAULT_TAGS, TGD, parse_value
from asyncgraph.text import (
    ask_json,
    current_models,
    describe,
    feedback_defaults,
    resolve_model,
    run_all,
    update_tokens,
    uses_structured,
)

__all__ = ["Candidate", "ParetoSearch", "SearchResult"]

MERGE_FIELD = "merged_variable"
"""The JSON field a merge comes back in when it is asked for with ``response_format``."""

FORMAT = "asyncgraph-pareto-search"
VERSION = 2

Forward = Callable[[Module, Mapping[str, Any]], Awaitable[Any]]
"""``forward(program, example)``: run ``program`` (a copy of the searched Module holding one
candidate's values) on one example; returns an object with ``.loss`` (a Variable) and
``.score`` (a number in [0, 1]), such as ``asyncgraph.jobs.Evaluation``, or a
``(loss, score)`` pair."""


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
class _Outcome:
    """What one work item of a round produced (a child or nothing) and how it went."""

    kind: str
    parents: tuple[int, ...]
    child: dict[str, Any] | None = None
    scores: list[float] | None = None
    stages: list[str] = field(default_factory=list)
    note: str = ""
    cost: tuple[int, int, float] = (0, 0, 0.0)
    """Model calls, tokens and dollars the item spent."""
    improved: bool = False
    """A greedy proposal whose child beat its parent on the minibatch."""


@dataclass
class _Draft:
    """A proposal after its rewrite: the child's values and the parent's minibatch."""

    outcome: _Outcome
    child: dict[str, Any]
    parent: dict[str, Any]
    examples: list[Mapping[str, Any]]
    before: float
    """The parent's summed score on the minibatch."""


def _key(values: Mapping[str, Any]) -> str:
    return json.dumps(values, sort_keys=True)


def _add_cost(outcome: _Outcome, spent: Any) -> None:
    calls, tokens, cost = outcome.cost
    outcome.cost = (
        calls + spent.requests,
        tokens + spent.total_tokens,
        cost + spent.cost_usd,
    )


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


def _positive(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"ParetoSearch: {name} must be an int >= {minimum}"
            + (" or None" if allow_none else "")
            + f", got {value!r}"
        )


class ParetoSearch:
    """Reflective Pareto search over the parameters of ``module`` (GEPA-style).

    ``await search.run()`` searches until the budget is spent, loads the best candidate
    (highest mean score on the Pareto set; the earliest on a tie) into ``module`` and
    returns a :class:`SearchResult`. ``await search.step()`` runs one round (False when the
    budget was spent and nothing ran), ``state_dict()`` / ``load_state_dict()`` save and
    restore the whole search between rounds (JSON data), so a job resumes mid-search and
    ends with the same result as an uninterrupted run with the same seed.

    - ``forward(program, example)`` (default: ``program(example)``) runs a copy of
      ``module`` holding one candidate's values and returns ``.loss`` and ``.score``
      (``asyncgraph.jobs.Evaluation``) or ``(loss, score)``. It must read the parameters
      from ``program`` (copies run concurrently), never from ``module`` itself.
    - The Pareto set: ``val_size`` examples of ``val_set`` (a seeded sample; all by
      default). Every accepted candidate is scored on each of them.
    - A proposal runs its parent on a ``minibatch_size`` sample of ``train_set`` with
      grad, backpropagates the losses of the examples scored below ``perfect_score``,
      and rewrites each parameter from its ``.grad`` with ``TGD`` (``tgd_options`` are
      passed on). A child equal to a candidate of the pool, or to an earlier sibling of
      its round (in plan order, after every rewrite of the round is known), is dropped
      before it costs a forward. The others are scored on the minibatch and kept only
      if better than the parent there.
    - Validation is spent in proportion to what it buys. The search starts *greedy*:
      one proposal a round, from the last accepted child (the *tip*), which is not
      validated yet: as in TGD, each accepted step builds on the last. The tip is
      scored on the Pareto set only when the chain stalls (``patience`` proposals in a
      row that did not improve) or when the budget left would not pay for one more
      proposal and that validation (or in the last round of ``max_rounds``); so a run
      of accepted rewrites costs one validation, not one each. Greedy ends (the search
      *widens*) when a validated tip is no better on the Pareto set than the candidate
      its chain began from, or when ``patience`` proposals in a row from the best
      validated candidate fail. ``patience=0`` starts wide.
    - A wide round draws ``proposals`` parents from the frontier (weighted by the
      number of examples each is best on; at most ``max_frontier`` candidates, the best
      covering ones). A child that beat its parent on its minibatch is scored on a
      seeded quarter of the Pareto set first, and on the rest only if it is at least as
      good as its parent on that quarter.
    - It also makes up to ``merges`` merges of frontier candidates that are each best
      on examples where the other is not (each pair once): per parameter, the version
      that changed since their common ancestor, or a model-written merge where both
      changed. A merge is kept if it does at least as well as both parents on the
      examples they win, then scored on the rest of the Pareto set.
    - Budget: ``max_calls`` model calls, ``max_tokens`` tokens and/or ``max_cost_usd``
      US dollars (counted with ``asyncgraph.models.track_usage``: cache hits are free;
      a cost cap needs every model priced: an unpriced call raises ``ModelConfigError``
      after the seed's evaluation), and/or ``max_rounds`` (rounds after the seed's
      evaluation, which is round 0); at least one. It is
      checked between rounds, and a round is shrunk to as many work items as the
      remaining budget affords at the cost of the dearest item so far (at least one).
      So while no item costs more than the dearest before it, the search ends within
      the budget, or over it by at most one item's cost when not even one fits (a
      greedy round that also validates its tip counts as one item).
    - ``model`` (a ChatModel or spec; default: the default feedback model) writes the
      rewrites and merges; ``executor`` runs the backwards (e.g. a Redis fleet).

    Everything that can run at once does: the proposals and merges of a round, the
    examples of each evaluation, and each backward's independent feedback requests.
    ``max_concurrency`` bounds the forwards in flight and, separately, every model call
    the search makes in this process, whichever object makes it (forwards, feedback,
    rewrites, merges: ``asyncgraph.models.limit_calls`` around each round; calls made
    on a remote ``executor``'s workers are bounded there). ``history`` holds one row per round:
    what ran, what was kept, the calls and tokens so far, and each work item's
    ``stages`` (the sequence of model-call phases it went through).

    Example::

        search = ParetoSearch(program, train, val, model="openai:gpt-4o-mini",
                              max_calls=2000, seed=0)
        result = await search.run()
        print(result.best_score, program.state_dict())

    The frontier arithmetic is pure functions of the candidates
    (``asyncgraph/optim/_frontier.py``); this class holds a search's state (the
    candidates, their scores, the budget, the history) and the rounds that grow it.
    """

    def __init__(
        self,
        module: Module,
        train_set: Sequence[Mapping[str, Any]],
        val_set: Sequence[Mapping[str, Any]],
        *,
        forward: Forward | None = None,
        model: str | ChatModel | None = None,
        base_url: str | None = None,
        max_calls: int | None = None,
        max_tokens: int | None = None,
        max_rounds: int | None = None,
        max_cost_usd: float | None = None,
        proposals: int = 4,
        merges: int = 1,
        minibatch_size: int = 4,
        val_size: int | None = None,
        max_frontier: int = 8,
        max_concurrency: int = 16,
        patience: int = 2,
        perfect_score: float = 1.0,
        seed: int = 0,
        tgd_options: Mapping[str, Any] | None = None,
        executor: Executor | None = None,
    ) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"ParetoSearch searches a Module's parameters, got {module!r:.80}")
        if not list(module.named_parameters()):
            raise ValueError(f"ParetoSearch: {type(module).__name__} has no parameters")
        if not train_set or not val_set:
            raise ValueError("ParetoSearch needs a non-empty train_set and val_set")
        if max_calls is None and max_tokens is None and max_rounds is None and max_cost_usd is None:
            raise ValueError(
                "ParetoSearch needs a budget: max_calls, max_tokens, max_cost_usd and/or max_rounds"
            )
        if max_cost_usd is not None and (
            isinstance(max_cost_usd, bool)
            or not isinstance(max_cost_usd, (int, float))
            or not 0 < max_cost_usd < math.inf
        ):
            raise ValueError(
                f"ParetoSearch: max_cost_usd must be a positive number of US dollars or None, "
                f"got {max_cost_usd!r}"
            )
        for name, value in (("max_calls", max_calls), ("max_tokens", max_tokens)):
            _positive(name, value, allow_none=True)
        _positive("max_rounds", max_rounds, allow_none=True)
        _positive("proposals", proposals)
        _positive("merges", merges, minimum=0)
        _positive("minibatch_size", minibatch_size)
        _positive("val_size", val_size, allow_none=True)
        _positive("max_frontier", max_frontier)
        _positive("max_concurrency", max_concurrency)
        _positive("patience", patience, minimum=0)
        if model is not None and not isinstance(model, (str, ChatModel)):
            raise TypeError(f"ParetoSearch: model must be a ChatModel or a spec, got {model!r}")
        self.module = module
        self.train_set = list(train_set)
        self.val_set = list(val_set)
        self.forward: Forward = forward if forward is not None else _call_program
        self.model = model
        self.base_url = base_url
        self.max_calls = max_calls
        self.max_tokens = max_tokens
        self.max_rounds = max_rounds
        self.max_cost_usd = max_cost_usd
        self.proposals = proposals
        self.merges = merges
        self.minibatch_size = min(minibatch_size, len(self.train_set))
        self.max_frontier = max_frontier
        self.max_concurrency = max_concurrency
        self.patience = patience
        self.perfect_score = float(perfect_score)
        self.seed = seed
        self.tgd_options = dict(tgd_options or {})
        self.executor = executor
        n_val = len(self.val_set) if val_size is None else min(val_size, len(self.val_set))
        indices = list(range(len(self.val_set)))
        if n_val < len(indices):
            indices = sorted(random.Random(f"{seed}:pareto").sample(indices, n_val))
        self.pareto_indices = indices
        # Search state (all of it in state_dict()).
        self.pool: list[Candidate] = []
        self.round = 0
        self.calls = 0
        self.tokens = 0
        self.cost_usd = 0.0
        self.work_done = 0
        self.dearest_item: tuple[int, int, float] = (0, 0, 0.0)
        """The most calls, tokens and dollars one work item has cost (sizes the last round)."""
        self.merged_pairs: set[tuple[int, int]] = set()
        self.history: list[dict[str, Any]] = []
        self.greedy = patience > 0
        """True while rounds are greedy (one proposal, from the tip)."""
        self.tip: dict[str, Any] | None = None
        """The greedy chain's last accepted child, not validated yet: ``values``, the
        ``parent`` (the validated candidate the chain began from) and its ``steps``."""
        self.idle = 0
        """Greedy proposals in a row that did not improve."""
        self._limiter: anyio.CapacityLimiter | None = None
        self.round_walls: list[float] = []
        """Wall time of each round run by this object (not part of the state)."""

    # -- state -----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "parameters": sorted(self.module.state_dict()),
            "seed": self.seed,
            "pareto_indices": list(self.pareto_indices),
            "train_size": len(self.train_set),
            "minibatch_size": self.minibatch_size,
            "patience": self.patience,
        }

    def state_dict(self) -> dict[str, Any]:
        """The whole search as JSON data (pool with scores, round, spending, history)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "identity": self._identity(),
            "round": self.round,
            "calls": self.calls,
            "tokens": self.tokens,
            "work_done": self.work_done,
            "cost_usd": self.cost_usd,
            "dearest_item": list(self.dearest_item),
            "pool": [c.to_data() for c in self.pool],
            "merged_pairs": sorted([a, b] for a, b in self.merged_pairs),
            "history": copy.deepcopy(self.history),
            "greedy": self.greedy,
            "tip": copy.deepcopy(self.tip),
            "idle": self.idle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (also after a JSON round trip) into a search
        built the same way (``ValueError`` if it was not)."""
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            raise ValueError("ParetoSearch.load_state_dict expects ParetoSearch.state_dict()")
        if state.get("version") != VERSION:
            raise ValueError(f"ParetoSearch state version {state.get('version')!r} unknown")
        identity = json.loads(json.dumps(self._identity()))
        if state.get("identity") != identity:
            raise ValueError(
                f"this ParetoSearch state belongs to another search: {state.get('identity')!r:.200}"
                f" was saved, this one is {identity!r:.200}"
            )
        try:
            pool = [Candidate.from_data(c) for c in state["pool"]]
            merged = {(int(a), int(b)) for a, b in state["merged_pairs"]}
            numbers = [int(state[k]) for k in ("round", "calls", "tokens", "work_done")]
            history = [dict(row) for row in state["history"]]
            dearest = [*state.get("dearest_item", ()), 0, 0, 0.0][:3]
            dearest_item = (int(dearest[0]), int(dearest[1]), float(dearest[2]))
            cost_usd = float(state.get("cost_usd", 0.0))
            greedy, idle = bool(state["greedy"]), int(state["idle"])
            tip = state["tip"]
            if tip is not None:
                tip = {
                    "values": copy.deepcopy(dict(tip["values"])),
                    "parent": int(tip["parent"]),
                    "steps": int(tip["steps"]),
                }
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"ParetoSearch state is corrupt: {exc!r}") from None
        for c in pool:
            if len(c.scores) != len(self.pareto_indices):
                raise ValueError(f"ParetoSearch state is corrupt: candidate {c.id}'s scores")
        self.pool, self.merged_pairs, self.history = pool, merged, history
        self.round, self.calls, self.tokens, self.work_done = numbers
        self.dearest_item, self.cost_usd = dearest_item, cost_usd
        self.greedy, self.tip, self.idle = greedy, tip, idle

    # -- budget ------------------------------------------------------------------------
    def exhausted(self) -> bool:
        """True once a budget (calls, tokens or rounds) is spent."""
        return (
            (self.max_calls is not None and self.calls >= self.max_calls)
            or (self.max_tokens is not None and self.tokens >= self.max_tokens)
            or (self.max_rounds is not None and self.round > self.max_rounds)
            or (self.max_cost_usd is not None and self.cost_usd >= self.max_cost_usd)
        )

    def _affordable(self, wanted: int) -> int:
        """How many work items the remaining budget affords at the dearest item's cost
        so far (at least one: the budget was not spent when the round began)."""
        dearest_calls, dearest_tokens, dearest_cost = self.dearest_item
        if self.work_done == 0:
            dearest_calls, dearest_tokens, dearest_cost = self._first_item_estimate()
        limit = wanted
        if self.max_calls is not None:
            limit = min(limit, (self.max_calls - self.calls) // max(1, dearest_calls))
        if self.max_tokens is not None:
            limit = min(limit, (self.max_tokens - self.tokens) // max(1, dearest_tokens))
        if self.max_cost_usd is not None and dearest_cost > 0:
            limit = min(limit, math.floor((self.max_cost_usd - self.cost_usd) / dearest_cost))
        return max(1, limit)

    def _first_item_estimate(self) -> tuple[int, int, float]:
        """What a proposal may cost before any has run, from the seed's evaluation (round
        0): its forward, backward and evaluation on a minibatch, a rewrite per parameter,
        and the evaluation of its child on the Pareto set, at the seed's cost an example."""
        seed = self.history[0] if self.history else {"calls": 0, "tokens": 0}
        seed_cost = float(seed.get("cost_usd", 0.0))
        examples = 3 * self.minibatch_size + len(self.pareto_indices)
        per_example = max(1, len(self.pareto_indices))
        rewrites = len(self.module.state_dict())
        calls = math.ceil(seed["calls"] / per_example * examples) + rewrites
        tokens = math.ceil(seed["tokens"] / per_example * examples) * 2
        return calls, tokens, seed_cost / per_example * examples * 2

    # -- models and evaluation -----------------------------------------------------
    def _model(self) -> ChatModel:
        model, base_url = self.model, self.base_url
        if model is None:
            model, base_url, _ = feedback_defaults("ParetoSearch", None, None)
        return resolve_model(model, base_url) if isinstance(model, str) else model

    def _program(self, values: Mapping[str, Any]) -> Module:
        program = self.module.clone()
        program.load_state_dict(values)
        return program

    async def _run_examples(
        self, program: Module, examples: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Variable, float]]:
        assert self._limiter is not None
        limiter = self._limiter
        results: list[tuple[Variable, float] | None] = [None] * len(examples)

        async def one(i: int) -> None:
            async with limiter:
                with graph_order(i):  # gradients meeting in a parameter sum in batch order
                    results[i] = _unpack(await self.forward(program, examples[i]))

        await run_all([functools.partial(one, i) for i in range(len(examples))])
        return [r for r in results if r is not None]

    async def _scores(self, values: Mapping[str, Any], indices: Sequence[int]) -> list[float]:
        """Scores of a candidate on val examples ``indices`` (no graph recorded)."""
        if not indices:
            return []
        with no_grad():
            results = await self._run_examples(
                self._program(values), [self.val_set[i] for i in indices]
            )
        return [score for _, score in results]

    # -- the frontier (the arithmetic is in _frontier, pure) ----------------------------
    def _wins(self) -> dict[int, set[int]]:
        return wins(self.pool)

    def frontier(self) -> list[tuple[Candidate, int]]:
        """The Pareto frontier: every candidate best on at least one example and dominated
        by none, with the number of examples it is best on; at most ``max_frontier`` (the
        widest coverage, then the best mean, then the oldest). Before any example is
        solved, the best candidate by mean alone."""
        if not self.pool:
            raise RuntimeError("ParetoSearch has no candidates yet: run it first")
        return pareto_frontier(self.pool, self.max_frontier)

    @property
    def best(self) -> Candidate:
        """The candidate with the highest mean score on the Pareto set (oldest on a tie)."""
        if not self.pool:
            raise RuntimeError("ParetoSearch has no candidates yet: run it first")
        return best_candidate(self.pool)

    def _by_id(self, cid: int) -> Candidate:
        return by_id(self.pool, cid)

    # -- a round -----------------------------------------------------------------------
    def _plan(self) -> list[tuple[str, Any]]:
        """The round's work items, drawn from a generator seeded by (seed, round)."""
        rng = random.Random(f"{self.seed}:round:{self.round}")
        frontier = self.frontier()
        items: list[tuple[str, Any]] = []
        for pair in self._merge_pairs(frontier)[: self.merges]:
            items.append(("merge", pair))
        for _ in range(self.proposals):
            (parent,) = rng.choices([c for c, _ in frontier], weights=[w for _, w in frontier])
            batch = sorted(rng.sample(range(len(self.train_set)), self.minibatch_size))
            items.append(("proposal", (parent.id, batch)))
        return items[: self._affordable(len(items))]

    def _merge_pairs(self, frontier: list[tuple[Candidate, int]]) -> list[tuple[int, int]]:
        return merge_pairs(self.pool, frontier, self.merged_pairs)

    def _tip_due(self) -> bool:
        """True when the greedy tip must be validated now: this is the last round of
        ``max_rounds``, or the budget left would not pay for one more proposal and the
        tip's validation (both at the dearest cost seen so far)."""
        if self.max_rounds is not None and self.round >= self.max_rounds:
            return True
        item = self.dearest_item if self.work_done else self._first_item_estimate()
        seed = self.history[0] if self.history else {"calls": 0, "tokens": 0}
        need = (
            item[0] + int(seed["calls"]),
            item[1] + int(seed["tokens"]),
            item[2] + float(seed.get("cost_usd", 0.0)),
        )
        return (
            (self.max_calls is not None and self.max_calls - self.calls < need[0])
            or (self.max_tokens is not None and self.max_tokens - self.tokens < need[1])
            or (self.max_cost_usd is not None and self.max_cost_usd - self.cost_usd < need[2])
        )

    async def step(self) -> bool:
        """Run one round (the seed's evaluation first, if not done); False if the budget
        was already spent (nothing ran). A greedy tip still unvalidated when the budget is
        spent is validated in one more round (over the budget by that validation)."""
        if self.pool and self.exhausted() and self.tip is None:
            return False
        started = time.perf_counter()
        self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        with track_usage() as usage, limit_calls(anyio.Semaphore(self.max_concurrency)):
            if not self.pool:
                values = self.module.state_dict()
                scores = await self._scores(values, self.pareto_indices)
                self.pool.append(Candidate(0, values, (), "seed", 0, scores))
                outcomes: list[_Outcome] = [_Outcome("seed", (), stages=["validation"])]
            elif self.tip is not None and self.exhausted():
                outcomes = [await self._validate_tip(_Outcome("validation", ()))]
            elif self.greedy:
                outcomes = [await self._greedy_round()]
            else:
                outcomes = await self._round()
        spent = usage.snapshot()
        self.calls += spent.requests
        self.tokens += spent.total_tokens
        self.cost_usd += spent.cost_usd
        if self.max_cost_usd is not None and spent.unpriced_requests:
            raise ModelConfigError(
                f"ParetoSearch: a model without a price answered {spent.unpriced_requests} "
                f"call(s), and a cost cap (max_cost_usd={self.max_cost_usd:g}) needs every "
                f"call priced: give the model a Pricing, or search without a cost cap",
                variable="pricing",
                value="None",
            )
        self.history.append(self._row(outcomes))
        self.round_walls.append(time.perf_counter() - started)
        self.round += 1
        return True

    def _tally(self, done: list[_Outcome]) -> None:
        self.work_done += len(done)
        self.dearest_item = (
            max([self.dearest_item[0], *(o.cost[0] for o in done)]),
            max([self.dearest_item[1], *(o.cost[1] for o in done)]),
            max([self.dearest_item[2], *(o.cost[2] for o in done)]),
        )

    def _add(
        self, values: dict[str, Any], parents: tuple[int, ...], kind: str, scores: list[float]
    ) -> int:
        cid = max(c.id for c in self.pool) + 1
        self.pool.append(Candidate(cid, values, parents, kind, self.round, scores))
        return cid

    # -- greedy rounds -------------------------------------------------------------------
    async def _greedy_round(self) -> _Outcome:
        """One proposal from the tip (or the best validated candidate); the tip is
        validated when the chain stalls or the budget is about to end."""
        tip = self.tip
        parent = self._by_id(tip["parent"]) if tip is not None else self.best
        values = tip["values"] if tip is not None else parent.values
        outcome = _Outcome("proposal", (parent.id,))
        if tip is not None and self._tip_due():
            outcome.kind = "validation"
            return await self._validate_tip(outcome)
        rng = random.Random(f"{self.seed}:round:{self.round}")
        batch = sorted(rng.sample(range(len(self.train_set)), self.minibatch_size))
        with track_usage() as usage:
            draft = await self._draft(values, batch, outcome)
            if draft is not None:
                if _key(draft.child) in {_key(c.values) for c in self.pool}:
                    outcome.note = "duplicate of a candidate (not scored)"
                elif await self._better_on_minibatch(draft):
                    steps = 1 + (tip["steps"] if tip is not None else 0)
                    self.tip = {"values": draft.child, "parent": parent.id, "steps": steps}
                    outcome.improved = True
                    outcome.note = f"accepted as the tip ({steps} step(s) from {parent.id})"
        _add_cost(outcome, usage.snapshot())
        self.idle = 0 if outcome.improved else self.idle + 1
        if self.tip is not None and (self.idle >= self.patience or self._tip_due_after(outcome)):
            return await self._validate_tip(outcome)
        if self.tip is None and self.idle >= self.patience:
            self.greedy = False
            outcome.note += "; greedy stalled: widening"
        self._tally([outcome])
        return outcome

    def _tip_due_after(self, outcome: _Outcome) -> bool:
        """``_tip_due`` once this round's spending so far is counted."""
        saved = self.calls, self.tokens, self.cost_usd, self.round
        self.calls += outcome.cost[0]
        self.tokens += outcome.cost[1]
        self.cost_usd += outcome.cost[2]
        self.round += 1
        try:
            return self._tip_due()
        finally:
            self.calls, self.tokens, self.cost_usd, self.round = saved

    async def _validate_tip(self, outcome: _Outcome) -> _Outcome:
        """Score the tip on the Pareto set and add it to the pool; widen if the chain did
        not beat the candidate it began from."""
        tip = self.tip
        assert tip is not None
        self.tip, self.idle = None, 0
        parent = self._by_id(tip["parent"])
        with track_usage() as usage:
            scores = await self._scores(tip["values"], self.pareto_indices)
        _add_cost(outcome, usage.snapshot())
        outcome.stages.append("validation")
        cid = self._add(tip["values"], (parent.id,), "proposal", scores)
        outcome.note += ("; " if outcome.note else "") + f"tip validated, kept as {cid}"
        if sum(scores) <= sum(parent.scores):
            self.greedy = False
            outcome.note += " (no better than its chain's start: widening)"
        self._tally([outcome])
        return outcome

    # -- wide rounds ---------------------------------------------------------------------
    async def _child_of(
        self, item: tuple[str, Any], outcome: _Outcome
    ) -> _Draft | dict[str, Any] | None:
        """A wide round's first phase: a proposal's rewrite or a merge's values."""
        kind, arg = item
        if kind != "merge":
            parent_id, batch = arg
            return await self._draft(self._by_id(parent_id).values, batch, outcome)
        a, b = self._by_id(arg[0]), self._by_id(arg[1])
        merged = await self._merged_values(a, b, outcome)
        if merged is not None and merged in (a.values, b.values):
            outcome.note = "merge equals a parent"
            return None
        return merged

    async def _round(self) -> list[_Outcome]:
        items = self._plan()
        outcomes = [
            _Outcome(kind, (arg[0],) if kind == "proposal" else tuple(arg)) for kind, arg in items
        ]
        drafts: list[_Draft | dict[str, Any] | None] = [None] * len(items)

        async def first(i: int) -> None:  # the rewrites and merges: what each child is
            with track_usage() as usage:  # nested: the round's meter counts these too
                drafts[i] = await self._child_of(items[i], outcomes[i])
            _add_cost(outcomes[i], usage.snapshot())

        await run_all([functools.partial(first, i) for i in range(len(items))])
        known = {_key(c.values) for c in self.pool}
        for i, draft in enumerate(drafts):  # in plan order: the same survivors every time
            if draft is None:
                continue
            key = _key(draft.child if isinstance(draft, _Draft) else draft)
            if key in known:
                outcomes[i].note = "duplicate (not scored)"
                drafts[i] = None
            known.add(key)

        async def second(i: int) -> None:  # the survivors' scores
            draft = drafts[i]
            with track_usage() as usage:
                if isinstance(draft, _Draft):
                    await self._check(draft, i)
                elif draft is not None:
                    await self._check_merge(draft, outcomes[i])
            _add_cost(outcomes[i], usage.snapshot())

        await run_all([functools.partial(second, i) for i in range(len(items))])
        self._tally(outcomes)
        for outcome in outcomes:  # in plan order: the pool does not depend on timing
            if outcome.kind == "merge":
                a, b = outcome.parents
                self.merged_pairs.add((min(a, b), max(a, b)))
            if outcome.child is None or outcome.scores is None:
                continue
            cid = self._add(outcome.child, outcome.parents, outcome.kind, outcome.scores)
            outcome.note = f"kept as {cid}"
        return outcomes

    def _row(self, outcomes: list[_Outcome]) -> dict[str, Any]:
        best = self.best
        return {
            "round": self.round,
            "work": [
                {
                    "kind": o.kind,
                    "parents": list(o.parents),
                    "stages": o.stages,
                    "note": o.note,
                    "calls": o.cost[0],
                    "tokens": o.cost[1],
                    "cost_usd": o.cost[2],
                }
                for o in outcomes
            ],
            "pool": len(self.pool),
            "greedy": self.greedy,
            "tip_steps": 0 if self.tip is None else self.tip["steps"],
            "frontier": [c.id for c, _ in self.frontier()],
            "best_id": best.id,
            "best_score": best.mean,
            "calls": self.calls,
            "tokens": self.tokens,
            "cost_usd": self.cost_usd,
        }

    async def _draft(
        self, values: dict[str, Any], batch: list[int], outcome: _Outcome
    ) -> _Draft | None:
        """The parent's forward on its minibatch, the backward of its failures and the
        rewrite: the child's values (None, with a note, when there is no new child)."""
        program = self._program(values)
        examples = [self.train_set[i] for i in batch]
        with enable_grad():
            results = await self._run_examples(program, examples)
        outcome.stages.append("forward")
        failing = [loss for loss, score in results if score < self.perfect_score]
        if not failing:
            outcome.note = "parent perfect on its minibatch"
            return None
        await backward(failing, executor=self.executor)
        outcome.stages.append("backward")
        tgd = TGD(program.parameters(), model=self._model(), **self.tgd_options)
        tgd.warn_skipped = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NoFeedbackWarning)
                await tgd.step()
        except UpdateParseError as exc:  # tgd_options={"strict": True}
            outcome.note = f"rewrite unreadable: {exc.role!r}"
            return None
        outcome.stages.append("rewrite")
        child = program.state_dict()
        if child == values:
            unread = [s.role for s in tgd.skipped]
            outcome.note = (
                f"rewrite unreadable: {unread[0]!r}" if unread else "rewrite changed nothing"
            )
            return None
        before = sum(score for _, score in results)
        return _Draft(outcome, child, dict(values), examples, before)

    async def _better_on_minibatch(self, draft: _Draft) -> bool:
        with no_grad():
            child_results = await self._run_examples(self._program(draft.child), draft.examples)
        draft.outcome.stages.append("minibatch")
        after = sum(score for _, score in child_results)
        if after <= draft.before:
            draft.outcome.note = f"no better on its minibatch ({after:g} <= {draft.before:g})"
            return False
        return True

    async def _check(self, draft: _Draft, index: int) -> None:
        """A wide round's child: its minibatch, then a seeded quarter of the Pareto set,
        then (at least as good as its parent there) the rest."""
        outcome = draft.outcome
        if not await self._better_on_minibatch(draft):
            return
        parent = self._by_id(outcome.parents[0])
        n = len(self.pareto_indices)
        rng = random.Random(f"{self.seed}:sample:{self.round}:{index}")
        sample = sorted(rng.sample(range(n), max(1, n // 4)))
        first = await self._scores(draft.child, [self.pareto_indices[j] for j in sample])
        outcome.stages.append("validation (sample)")
        got, need = sum(first), sum(parent.scores[j] for j in sample)
        if got < need:
            outcome.note = (
                f"worse than its parent on a sample of the Pareto set ({got:g} < {need:g})"
            )
            return
        rest = [j for j in range(n) if j not in set(sample)]
        outcome.scores = self._combine(
            sample,
            first,
            rest,
            await self._scores(draft.child, [self.pareto_indices[j] for j in rest]),
        )
        outcome.stages.append("validation (rest)")
        outcome.child = draft.child

    def _combine(
        self, first: list[int], first_scores: list[float], rest: list[int], rest_scores: list[float]
    ) -> list[float]:
        scores = [0.0] * len(self.pareto_indices)
        for j, s in [*zip(first, first_scores, strict=True), *zip(rest, rest_scores, strict=True)]:
            scores[j] = s
        return scores

    async def _merge(self, a_id: int, b_id: int) -> _Outcome:
        """One merge of candidates ``a_id`` and ``b_id``, scored (the child or a note)."""
        a, b = self._by_id(a_id), self._by_id(b_id)
        outcome = _Outcome("merge", (a_id, b_id))
        merged = await self._merged_values(a, b, outcome)
        if merged is None:
            return outcome
        if merged in (a.values, b.values):
            outcome.note = "merge equals a parent"
            return outcome
        await self._check_merge(merged, outcome)
        return outcome

    async def _check_merge(self, merged: dict[str, Any], outcome: _Outcome) -> None:
        """A merge is kept if it does at least as well as both parents on the examples
        they win; then it is scored on the rest of the Pareto set."""
        a_id, b_id = outcome.parents
        a, b = self._by_id(a_id), self._by_id(b_id)
        wins = self._wins()
        shared = sorted(wins[a_id] | wins[b_id])
        first_scores = await self._scores(merged, [self.pareto_indices[j] for j in shared])
        outcome.stages.append("validation (won examples)")
        got = sum(first_scores)
        need = max(sum(a.scores[j] for j in shared), sum(b.scores[j] for j in shared))
        if got < need:
            outcome.note = f"worse than a parent where they win ({got:g} < {need:g})"
            return
        rest = [j for j in range(len(self.pareto_indices)) if j not in set(shared)]
        rest_scores = await self._scores(merged, [self.pareto_indices[j] for j in rest])
        outcome.stages.append("validation (rest)")
        outcome.child, outcome.scores = (
            merged,
            self._combine(shared, first_scores, rest, rest_scores),
        )

    async def _merged_values(
        self, a: Candidate, b: Candidate, outcome: _Outcome
    ) -> dict[str, Any] | None:
        """Per parameter: the shared value, the one that changed since the common ancestor,
        or (both changed) a merge written by the model. None if a merge is unreadable."""
        common = ancestors(self.pool, a.id) & ancestors(self.pool, b.id)
        ancestor = self._by_id(max(common)).values if common else {}
        merged: dict[str, Any] = {}
        asks: list[str] = []
        for name, first in a.values.items():
            second, base = b.values[name], ancestor.get(name)
            if first == second or second == base:
                merged[name] = first
            elif first == base:
                merged[name] = second
            elif isinstance(first, str) and isinstance(second, str):
                asks.append(name)
            else:
                merged[name] = first if a.mean >= b.mean else second
        if not asks:
            return merged
        model = self._model()
        roles = {n: p.role for n, p in self.module.named_parameters()}

        async def ask(name: str) -> None:
            merged[name] = await self._merge_text(
                model, roles.get(name, name), a.values[name], b.values[name], ancestor.get(name)
            )

        await run_all([functools.partial(ask, name) for name in asks])
        outcome.stages.append("merge")
        unreadable = [name for name in asks if not merged[name]]
        if unreadable:
            outcome.note = f"merge of {unreadable[0]!r} unreadable"
            return None
        return {name: merged[name] for name in a.values}

    async def _merge_text(
        self, model: ChatModel, role: str, first: str, second: str, ancestor: Any
    ) -> str | None:
        """A merge written by ``model``, asked for as TGD asks for updates (structured
        outputs where the model takes them, else tags); None when it is unreadable."""
        open_tag, close_tag = self.tgd_options.get("tags", DEFAULT_TAGS)
        structured = self.tgd_options.get("structured", "auto")
        tags = ValueForm(open_tag, close_tag)
        form = (
            ValueForm(open_tag, close_tag, MERGE_FIELD)
            if uses_structured(model, structured, unknown=False)
            else tags
        )

        def request(form: ValueForm) -> list[dict[str, Any]]:
            return merge_messages(
                role=describe(role, "variable"),
                first=first,
                second=second,
                ancestor=ancestor if isinstance(ancestor, str) else None,
                open_tag=open_tag,
                close_tag=close_tag,
                form=form,
            )

        params = self.tgd_options.get("model_params")
        if params is None:
            params = current_models().for_feedback()[2]
        with reply_tokens(update_tokens(first) + update_tokens(second), whole=True):
            if form.field is not None:
                completion, sent = await ask_json(
                    model,
                    request(form),
                    params,
                    form.schema(),
                    structured=structured,
                    fallback=request(tags),
                    strict=True,
                    usable=lambda text: bool(parse_value(text, form)),
                )
                return parse_value(completion.text, form if sent else tags) or None
            messages = request(tags)
            if isinstance(model, BaseChatModel):
                reply = await model.complete(
                    messages, cache_if=lambda c: bool(parse_value(c.text, tags)), **params
                )
            else:
                reply = await model.complete(messages, **params)
        return parse_value(reply.text, tags) or None

    # -- running -------------------------------------------------------------------
    async def run(
        self, on_round: Callable[[ParetoSearch], Awaitable[None] | None] | None = None
    ) -> SearchResult:
        """Search until the budget is spent; ``on_round(self)`` (sync or async) after each
        round, e.g. to checkpoint ``state_dict()``. Loads the best candidate into the
        Module and returns the result."""
        started = time.perf_counter()
        while await self.step():
            if on_round is not None:
                result = on_round(self)
                if result is not None:
                    await result
        return self.finish(time.perf_counter() - started)

    def finish(self, wall_s: float = 0.0) -> SearchResult:
        """Load the best candidate into the Module; the result so far."""
        best = self.best
        self.module.load_state_dict(best.values)
        return SearchResult(
            best=best,
            rounds=self.round,
            calls=self.calls,
            tokens=self.tokens,
            pool_size=len(self.pool),
            frontier=[c.id for c, _ in self.frontier()],
            history=copy.deepcopy(self.history),
            wall_s=wall_s,
            cost_usd=self.cost_usd,
        )


async def _call_program(program: Module, example: Mapping[str, Any]) -> Any:
    return await program(example)
