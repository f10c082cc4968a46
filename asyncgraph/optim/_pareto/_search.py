"""``ParetoSearch``, the loop: a search's options, its state, and the rounds that grow it.

Each round is built from the search's parts when it starts: an ``Evaluator`` bounded by
the round's limiter, a ``Drafter`` and a ``Merger`` that resolve the model when they call
it, and the round itself (``GreedyChain`` or ``WideRound``) on the search's one
``SearchState``. Between rounds, the state and the options are all there is, so
``state_dict()`` saves a search whole.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from asyncgraph import Executor, Module
from asyncgraph.models import ChatModel, limit_calls, track_usage
from asyncgraph.optim._frontier import Candidate, merge_pairs
from asyncgraph.optim._tgd import SkippedUpdate

from ._budget import Budget, item_cost
from ._drafting import Drafter
from ._greedy import GreedyChain
from ._merging import Merger
from ._options import check_options, feedback_model
from ._outcome import Cost, Outcome
from ._state import SearchResult, SearchState, StateField, checkpoint, restore
from ._validation import Evaluator, Forward, call_program
from ._wide import WideRound

__all__ = ["ParetoSearch"]


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
    what ran, what was kept, the calls and tokens so far, each work item's ``stages``
    (the sequence of model-call phases it went through) and, when a rewrite or a merge
    could not be read, ``skipped_updates`` (as ``search.skipped`` after the step: the
    parameter's role, the replies tried, the last one; no child was made of it);
    ``tgd_options={"strict": True}`` raises ``UpdateParseError`` from the step instead,
    as ``TGD(strict=True)`` does.

    Example::

        search = ParetoSearch(program, train, val, model="openai:gpt-4o-mini",
                              max_calls=2000, seed=0)
        result = await search.run()
        print(result.best_score, program.state_dict())

    The search's state (the candidates, their scores, what was spent, the history, the
    greedy chain) is one ``SearchState``, each field of it also an attribute of the
    search (``search.pool``, ``search.round``, ``search.calls``, ...). The parts of a
    round are one module each in ``asyncgraph/optim/_pareto/``.
    """

    # The fields of the search's state, each an attribute of the search.
    pool: StateField[list[Candidate]] = StateField()
    """The candidates, oldest first, each with its scores on the Pareto set."""
    round: StateField[int] = StateField()
    """The number of the next round (round 0 is the seed's evaluation)."""
    calls: StateField[int] = StateField()
    """Model calls made so far."""
    tokens: StateField[int] = StateField()
    """Tokens spent so far."""
    cost_usd: StateField[float] = StateField()
    """US dollars spent so far."""
    work_done: StateField[int] = StateField()
    """Work items run so far (proposals, merges, validations of the tip)."""
    dearest_item: StateField[tuple[int, int, float]] = StateField()
    """The most calls, tokens and dollars one work item has cost (sizes the last round)."""
    merged_pairs: StateField[set[tuple[int, int]]] = StateField()
    """The pairs of candidate ids merged already (each pair is merged once)."""
    history: StateField[list[dict[str, Any]]] = StateField()
    """One row per round: what ran, what was kept, the spending so far."""
    greedy: StateField[bool] = StateField()
    """True while rounds are greedy (one proposal, from the tip)."""
    tip: StateField[dict[str, Any] | None] = StateField()
    """The greedy chain's last accepted child, not validated yet: ``values``, the
    ``parent`` (the validated candidate the chain began from) and its ``steps``."""
    idle: StateField[int] = StateField()
    """Greedy proposals in a row that did not improve."""

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
        check_options(
            module,
            train_set,
            val_set,
            budget=Budget(max_calls, max_tokens, max_rounds, max_cost_usd),
            counts={
                "proposals": proposals,
                "merges": merges,
                "minibatch_size": minibatch_size,
                "val_size": val_size,
                "max_frontier": max_frontier,
                "max_concurrency": max_concurrency,
                "patience": patience,
            },
            model=model,
        )
        self.module = module
        self.train_set = list(train_set)
        self.val_set = list(val_set)
        self.forward: Forward = forward if forward is not None else call_program
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
        self.state = SearchState(greedy=patience > 0)
        """The search's state: all of it is in ``state_dict()``."""
        self._limiter: anyio.CapacityLimiter | None = None
        self.round_walls: list[float] = []
        """Wall time of each round run by this object (not part of the state)."""
        self.skipped: list[SkippedUpdate] = []
        """The last ``step()``'s rewrites and merges whose reply could not be read, as
        ``TGD.skipped`` (their children were not made; the round's notes say so too)."""

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
        return checkpoint(self.state, self._identity())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (also after a JSON round trip) into a search
        built the same way (``ValueError`` if it was not)."""
        self.state = restore(state, self._identity(), len(self.pareto_indices))

    def frontier(self) -> list[tuple[Candidate, int]]:
        """The Pareto frontier: every candidate best on at least one example and dominated
        by none, with the number of examples it is best on; at most ``max_frontier`` (the
        widest coverage, then the best mean, then the oldest). Before any example is
        solved, the best candidate by mean alone."""
        return self.state.frontier(self.max_frontier)

    @property
    def best(self) -> Candidate:
        """The candidate with the highest mean score on the Pareto set (oldest on a tie)."""
        return self.state.best

    # -- budget ------------------------------------------------------------------------
    @property
    def _budget(self) -> Budget:
        return Budget(self.max_calls, self.max_tokens, self.max_rounds, self.max_cost_usd)

    def exhausted(self) -> bool:
        """True once a budget (calls, tokens or rounds) is spent."""
        return self._budget.exhausted(self.state)

    # -- the parts of a round (built when it starts) ------------------------------------
    def _evaluator(self) -> Evaluator:
        assert self._limiter is not None  # step() makes the round's
        return Evaluator(
            self.module, self.forward, self.val_set, self.pareto_indices, self._limiter
        )

    def _parts(self) -> tuple[SearchState, Budget, Cost, Evaluator, Drafter]:
        """What every round works with (``Round``'s fields)."""
        evaluator = self._evaluator()
        drafter = Drafter(
            evaluator,
            self.train_set,
            self.minibatch_size,
            model=functools.partial(feedback_model, self.model, self.base_url),
            perfect_score=self.perfect_score,
            tgd_options=self.tgd_options,
            executor=self.executor,
            skipped=self.skipped,
        )
        item = item_cost(
            self.state,
            minibatch_size=self.minibatch_size,
            pareto_size=len(self.pareto_indices),
            parameters=len(self.module.state_dict()),
        )
        return self.state, self._budget, item, evaluator, drafter

    def _greedy(self) -> GreedyChain:
        return GreedyChain(*self._parts(), patience=self.patience)

    def _wide(self) -> WideRound:
        merger = Merger(
            self.module,
            model=functools.partial(feedback_model, self.model, self.base_url),
            tgd_options=self.tgd_options,
            skipped=self.skipped,
        )
        return WideRound(
            *self._parts(),
            merger=merger,
            proposals=self.proposals,
            merges=self.merges,
            max_frontier=self.max_frontier,
            seed=self.seed,
        )

    def _merge_pairs(self, frontier: list[tuple[Candidate, int]]) -> list[tuple[int, int]]:
        return merge_pairs(self.pool, frontier, self.merged_pairs)

    async def _merge(self, a_id: int, b_id: int) -> Outcome:
        """One merge of candidates ``a_id`` and ``b_id``, scored (the child or a note)."""
        return await self._wide().merge(a_id, b_id)

    # -- running -------------------------------------------------------------------
    async def step(self) -> bool:
        """Run one round (the seed's evaluation first, if not done); False if the budget
        was already spent (nothing ran). A greedy tip still unvalidated when the budget is
        spent is validated in one more round (over the budget by that validation)."""
        if self.pool and self.exhausted() and self.tip is None:
            return False
        started = time.perf_counter()
        self.skipped = []
        self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        with track_usage() as usage, limit_calls(anyio.Semaphore(self.max_concurrency)):
            outcomes = await self._round()
        spent = usage.snapshot()
        self.state.spend(spent)
        self._budget.check_priced(spent)
        row = self.state.row(outcomes, self.max_frontier)
        if self.skipped:
            row["skipped_updates"] = [skipped.to_data() for skipped in self.skipped]
        self.history.append(row)
        self.round_walls.append(time.perf_counter() - started)
        self.round += 1
        return True

    async def _round(self) -> list[Outcome]:
        """The round's work: the seed's evaluation, the tip's last validation, a greedy
        round or a wide one; its draws come from a generator seeded by (seed, round)."""
        rng = random.Random(f"{self.seed}:round:{self.round}")
        if not self.pool:
            values = self.module.state_dict()
            scores = await self._evaluator().pareto_scores(values)
            self.pool.append(Candidate(0, values, (), "seed", 0, scores))
            return [Outcome("seed", (), stages=["validation"])]
        if self.tip is not None and self.exhausted():
            return [await self._greedy().validate_tip(Outcome("validation", ()))]
        if self.greedy:
            return [await self._greedy().round(rng)]
        return await self._wide().run(rng)

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
        self.module.load_state_dict(self.best.values)
        return self.state.result(self.max_frontier, wall_s)
