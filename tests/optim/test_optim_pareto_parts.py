"""The parts of ``ParetoSearch`` that decide without a model (``asyncgraph.optim._pareto``):
the budget's decisions, the merge of what each parent changed, the checkpoint, and the
state's fields shown as the search's attributes."""

from __future__ import annotations

import json

import pytest
from skills_task import TRAIN, VAL, SkillProgram, make_model

from asyncgraph.optim import Candidate, ParetoSearch
from asyncgraph.optim._pareto._budget import Budget, item_cost
from asyncgraph.optim._pareto._merging import changes
from asyncgraph.optim._pareto._state import SearchState, checkpoint, restore


def test_a_round_affords_what_the_budget_left_pays_at_the_dearest_items_cost() -> None:
    state = SearchState(calls=80, tokens=1000, cost_usd=0.5, work_done=3)
    item = (10, 100, 0.25)
    assert Budget(100, None, None, None).affordable(state, 4, item) == 2  # 20 calls left
    assert Budget(100, 1150, None, None).affordable(state, 4, item) == 1  # 150 tokens left
    assert Budget(None, None, None, 1.0).affordable(state, 4, item) == 2  # $0.50 left
    assert Budget(None, None, 9, None).affordable(state, 4, item) == 4  # rounds: no cut
    # The budget was not spent when the round began: one item runs even if it overshoots.
    assert Budget(85, None, None, None).affordable(state, 4, item) == 1


def test_the_search_is_over_when_any_limit_is_spent() -> None:
    state = SearchState(round=3, calls=100, tokens=10, cost_usd=0.5)
    assert not Budget(101, None, 3, None).exhausted(state)  # round 3 of 3 still runs
    assert Budget(100, None, None, None).exhausted(state)
    assert Budget(None, None, 2, None).exhausted(state)
    assert Budget(None, 10, None, None).exhausted(state)
    assert Budget(None, None, None, 0.5).exhausted(state)


def test_the_tip_is_due_when_the_budget_left_cannot_pay_an_item_and_a_validation() -> None:
    # A validation costs what the seed's evaluation did (11 calls); an item 10 calls.
    state = SearchState(round=4, calls=70, history=[{"calls": 11, "tokens": 0}], work_done=1)
    item = (10, 0, 0.0)
    budget = Budget(100, None, None, None)
    assert not budget.tip_due(state, item)  # 30 calls left: 21 needed
    assert budget.tip_due(state, item, this_round=(10, 0, 0.0))  # 20 left at the round's end
    assert state.calls == 70  # asked as at the round's end, not counted
    rounds = Budget(None, None, 5, None)
    assert not rounds.tip_due(state, item)  # round 4 of 5
    assert rounds.tip_due(state, item, this_round=(0, 0, 0.0))  # the next is the last


def test_before_any_item_has_run_its_cost_is_estimated_from_the_seeds_evaluation() -> None:
    seed_row = {"calls": 10, "tokens": 1000, "cost_usd": 0.01}  # 10 examples of the Pareto set
    state = SearchState(history=[seed_row])
    # A minibatch's forward, feedback and check (3 x 4 examples), the child on the Pareto
    # set (10), at the seed's cost an example, a rewrite per parameter; twice the tokens.
    cost = item_cost(state, minibatch_size=4, pareto_size=10, parameters=2)
    assert cost == (22 + 2, 2200 * 2, pytest.approx(0.01 / 10 * 22 * 2))
    state.work_done, state.dearest_item = 1, (7, 70, 0.07)
    assert item_cost(state, minibatch_size=4, pareto_size=10, parameters=2) == (7, 70, 0.07)


def test_a_merge_takes_what_each_parent_changed_and_asks_for_texts_both_changed() -> None:
    ancestor = {"p": "p0", "q": "q0", "r": "r0", "n": 0, "same": "s"}
    a_values = {"p": "p1", "q": "q0", "r": "ra", "n": 1, "same": "s"}
    b_values = {"p": "p0", "q": "q2", "r": "rb", "n": 2, "same": "s"}
    a = Candidate(1, a_values, (0,), "proposal", 1, [1.0, 0.0])
    b = Candidate(2, b_values, (0,), "proposal", 1, [0.0, 0.0])
    merged, asks = changes(a, b, ancestor)
    # Not text, changed on both sides: the better parent's (a, by mean).
    assert merged == {"p": "p1", "q": "q2", "n": 1, "same": "s"}
    assert asks == ["r"]


def test_a_checkpoint_restores_the_whole_state_and_refuses_another_searchs() -> None:
    state = SearchState(
        pool=[
            Candidate(0, {"p": "a"}, (), "seed", 0, [0.0, 1.0]),
            Candidate(1, {"p": "b"}, (0,), "proposal", 1, [1.0, 1.0]),
        ],
        round=2,
        calls=30,
        tokens=900,
        cost_usd=0.25,
        work_done=1,
        dearest_item=(20, 600, 0.125),
        merged_pairs={(0, 1)},
        history=[{"round": 0}, {"round": 1}],
        greedy=True,
        tip={"values": {"p": "c"}, "parent": 1, "steps": 2},
        idle=1,
    )
    identity = {"seed": 0, "pareto_indices": [0, 1]}
    data = json.loads(json.dumps(checkpoint(state, identity)))
    assert restore(data, identity, 2) == state
    with pytest.raises(ValueError, match="belongs to another search"):
        restore(data, {**identity, "seed": 1}, 2)
    with pytest.raises(ValueError, match="candidate 0's scores"):
        restore(data, identity, 3)
    with pytest.raises(ValueError, match="corrupt"):
        restore({**data, "idle": "x"}, identity, 2)


def test_the_search_shows_each_field_of_its_state_as_an_attribute() -> None:
    model = make_model()
    search = ParetoSearch(SkillProgram(model), TRAIN, VAL, model=model, max_calls=10)
    assert search.pool is search.state.pool and search.greedy is True
    search.round = 5
    assert search.state.round == 5
    saved = search.state_dict()
    fresh = ParetoSearch(SkillProgram(model), TRAIN, VAL, model=model, max_calls=10)
    fresh.load_state_dict(saved)  # the state is replaced whole; the attributes follow
    assert fresh.round == 5 and fresh.history == [] and fresh.tip is None
