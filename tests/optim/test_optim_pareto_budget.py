"""ParetoSearch spends its budget where it pays: duplicates dropped before they are scored,
greedy steps validated once a chain stalls, every model call held to max_concurrency, and
the one-rule-at-a-time task solved within about TGD's calls."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import rules_task
from skills_task import BASE, INSTRUCTIONS, TRAIN, VAL, SkillProgram, make_model, respond

from asyncgraph.models import SimulatedModel
from asyncgraph.optim import ParetoSearch

pytestmark = pytest.mark.anyio

ONLY_A = [row for row in TRAIN if row["skill"] == "a"]  # every rewrite adds the same rule


async def test_identical_siblings_are_scored_once() -> None:
    child_calls: list[str] = []

    def watching(messages: list[dict[str, Any]]) -> str:
        if INSTRUCTIONS["a"] in str(messages[0]["content"]):  # the child answering
            child_calls.append(str(messages[-1]["content"]))
        return respond(messages)

    model = SimulatedModel(latency_s=0.0, responder=watching, tag_replies=False)
    search = ParetoSearch(
        SkillProgram(model), ONLY_A, VAL, model=model, max_rounds=1, proposals=2, merges=0,
        patience=0, seed=0,
    )  # fmt: skip
    result = await search.run()
    first, second = result.history[1]["work"]
    assert first["stages"] == [
        "forward", "backward", "rewrite", "minibatch", "validation (sample)",
        "validation (rest)",
    ]  # fmt: skip
    assert first["note"] == "kept as 1"
    assert second["stages"] == ["forward", "backward", "rewrite"]
    assert second["note"] == "duplicate (not scored)"
    # The duplicate cost its forward (4), feedback (4) and rewrite (1) only.
    assert second["calls"] == 9 and first["calls"] == 9 + 4 + len(VAL)
    assert len(child_calls) == 4 + len(VAL)  # one minibatch and one validation
    assert result.calls == len(VAL) + first["calls"] + second["calls"]
    assert len(search.pool) == 2


async def test_a_child_equal_to_a_candidate_is_not_scored_in_greedy_rounds() -> None:
    model = make_model()
    search = ParetoSearch(SkillProgram(model), ONLY_A, VAL, model=model, max_rounds=8, seed=0)
    result = await search.run()
    notes = [w["note"] for row in result.history for w in row["work"]]
    assert any("tip validated" in n for n in notes)
    assert [c.values["prompt"] for c in search.pool] == [BASE, f"{BASE} {INSTRUCTIONS['a']}"]


@pytest.mark.parametrize("patience", [2, 0])
async def test_max_concurrency_bounds_every_model_call(patience: int) -> None:
    running = 0
    peak = 0
    kinds: set[str] = set()

    async def counting(messages: list[dict[str, Any]]) -> str:
        nonlocal running, peak
        text = "\n".join(str(m["content"]) for m in messages)
        kinds.add(
            "merge" if "<VARIABLE_A>" in text
            else "rewrite" if "IMPROVED_VARIABLE" in text
            else "feedback" if "<OUTPUT_FEEDBACK>" in text
            else "forward"
        )  # fmt: skip
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.005)
        running -= 1
        return respond(messages)

    # The forwards and the search's rewrites go through two model objects: one bound.
    solver = SimulatedModel(latency_s=0.0, responder=counting, tag_replies=False)
    writer = SimulatedModel(latency_s=0.0, responder=counting, tag_replies=False)
    search = ParetoSearch(
        SkillProgram(solver), TRAIN, VAL, model=writer, max_rounds=8, max_concurrency=3,
        patience=patience, seed=0,
    )  # fmt: skip
    await search.run()
    assert peak == 3  # reached, never passed
    assert {"forward", "feedback", "rewrite"} <= kinds
    if patience == 0:
        assert "merge" in kinds


async def test_a_model_calling_a_model_takes_one_slot() -> None:
    from asyncgraph.models import limit_calls

    inner = SimulatedModel(latency_s=0.0, responder=lambda m: "inner", tag_replies=False)

    async def outer_reply(messages: list[dict[str, Any]]) -> str:
        return (await inner.complete(messages)).text  # a wrapper model's call

    outer = SimulatedModel(latency_s=0.0, responder=outer_reply, tag_replies=False)
    with anyio.fail_after(60), limit_calls(anyio.Semaphore(1)):
        answer = await outer.complete([{"role": "user", "content": "hi"}])
    assert answer.text == "inner"


async def test_resume_mid_chain_ends_like_an_uninterrupted_run() -> None:
    model = make_model()
    whole = ParetoSearch(SkillProgram(model), TRAIN, VAL, model=model, max_calls=300, seed=3)
    await whole.run()
    first = ParetoSearch(SkillProgram(model), TRAIN, VAL, model=model, max_calls=300, seed=3)
    for _ in range(3):
        await first.step()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["tip"] is not None  # interrupted with an unvalidated tip
    resumed = ParetoSearch(SkillProgram(model), TRAIN, VAL, model=model, max_calls=300, seed=3)
    resumed.load_state_dict(state)
    await resumed.run()
    assert resumed.state_dict() == whole.state_dict()


@pytest.mark.parametrize("budget", [60, 90, 140])
async def test_a_pending_tip_is_validated_before_the_budget_ends(budget: int) -> None:
    model = rules_task.make_model()
    search = ParetoSearch(
        rules_task.RuleProgram(model), rules_task.TRAIN, rules_task.VAL, model=model,
        max_calls=budget, seed=0,
    )  # fmt: skip
    result = await search.run()
    assert search.tip is None
    assert result.best.mean > 0  # the greedy steps were not lost
    assert result.calls - budget <= max(w["calls"] for r in result.history for w in r["work"])


async def test_one_rule_at_a_time_within_tgd_calls_and_two_validations() -> None:
    # TGD (batches of 8) needs about 80 calls to add the 6 rules. The search pays TGD's
    # steps in cheaper greedy steps (minibatches of 4), plus two passes over the Pareto set
    # TGD does not make: the seed's and the chain's.
    tgd = [await rules_task.tgd_calls_to_best(seed) for seed in range(3)]
    assert all(c is not None for c in tgd)
    budget = round(sum(c for c in tgd if c is not None) / 3) + 2 * len(rules_task.VAL)
    for seed in range(3):
        model = rules_task.make_model()
        program = rules_task.RuleProgram(model)
        search = ParetoSearch(
            program, rules_task.TRAIN, rules_task.VAL, model=model, max_calls=budget, seed=seed
        )
        result = await search.run()
        assert result.best.values == {"prompt": rules_task.BEST}, (seed, budget, result.calls)
