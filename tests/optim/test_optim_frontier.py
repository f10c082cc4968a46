"""ParetoSearch's frontier arithmetic (``asyncgraph.optim._frontier``): pure, no model."""

from __future__ import annotations

from asyncgraph.optim._frontier import (
    Candidate,
    ancestors,
    best_candidate,
    merge_pairs,
    pareto_frontier,
    wins,
)


def cand(cid: int, scores: list[float], parents: tuple[int, ...] = ()) -> Candidate:
    return Candidate(cid, {"p": str(cid)}, parents, "proposal" if parents else "seed", 0, scores)


def test_a_candidate_wins_the_examples_where_its_score_is_best_and_above_zero() -> None:
    pool = [cand(0, [1.0, 0.0, 0.5]), cand(1, [1.0, 0.0, 0.2]), cand(2, [0.0, 0.0, 0.9])]
    # Example 0: a tie, both win; example 1: nobody scored, nobody wins.
    assert wins(pool) == {0: {0}, 1: {0}, 2: {2}}
    assert wins([]) == {}


def test_the_frontier_drops_dominated_candidates_and_keeps_the_oldest_of_equals() -> None:
    pool = [
        cand(0, [0.5, 0.5]),
        cand(1, [1.0, 0.0]),
        cand(2, [1.0, 0.0]),  # the same scores as 1: 1 stands for both
        cand(3, [0.4, 0.5]),  # dominated by 0
        cand(4, [0.0, 1.0]),
    ]
    assert [(c.id, n) for c, n in pareto_frontier(pool, 8)] == [(1, 1), (4, 1)]


def test_the_frontier_keeps_the_widest_coverage_then_the_best_mean_when_capped() -> None:
    pool = [
        cand(0, [1.0, 1.0, 0.0, 0.0]),  # wins 2
        cand(1, [0.0, 0.0, 1.0, 0.0]),  # wins 1, mean 0.25
        cand(2, [0.0, 0.5, 0.0, 1.0]),  # wins 1, mean 0.375
    ]
    assert [c.id for c, _ in pareto_frontier(pool, 2)] == [0, 2]  # in id order


def test_before_any_example_is_won_the_frontier_is_the_best_candidate_alone() -> None:
    pool = [cand(0, [0.0, 0.0]), cand(1, [0.0, 0.0])]
    assert [(c.id, n) for c, n in pareto_frontier(pool, 8)] == [(0, 1)]
    assert best_candidate([cand(0, [0.5]), cand(1, [0.5]), cand(2, [0.2])]).id == 0  # oldest tie


def test_ancestors_follow_every_parent() -> None:
    pool = [cand(0, [1]), cand(1, [1], (0,)), cand(2, [1], (0,)), cand(3, [1], (1, 2))]
    assert ancestors(pool, 3) == {0, 1, 2, 3}
    assert ancestors(pool, 2) == {0, 2}


def test_merge_pairs_are_complementary_not_yet_merged_widest_first() -> None:
    pool = [
        cand(0, [1.0, 0.0, 0.0, 0.0]),
        cand(1, [0.0, 1.0, 1.0, 0.0]),
        cand(2, [0.0, 0.0, 0.0, 1.0]),
    ]
    frontier = pareto_frontier(pool, 8)
    assert merge_pairs(pool, frontier, set()) == [(0, 1), (1, 2), (0, 2)]
    assert merge_pairs(pool, frontier, {(0, 1)}) == [(1, 2), (0, 2)]
    # A candidate winning nothing the other does not win is no merge partner.
    same = [cand(0, [1.0, 1.0]), cand(1, [1.0, 0.0])]
    assert merge_pairs(same, [(same[0], 2), (same[1], 1)], set()) == []
