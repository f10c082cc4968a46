"""ParetoSearch: frontier, proposals from textual gradients, merges, budget, determinism,
resume from state_dict, concurrency."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
from skills_task import (
    BASE,
    INSTRUCTIONS,
    TRAIN,
    VAL,
    SkillProgram,
    accuracy,
    make_model,
    respond,
    with_instructions,
)

from asyncgraph import Module, Parameter, Variable
from asyncgraph.models import ModelConfigError, OpenAIChat, Pricing, SimulatedModel
from asyncgraph.models._testing_local import LocalModelTestServer
from asyncgraph.optim import Candidate, ParetoSearch, UpdateParseError
from asyncgraph.optim._pareto._merging import Merger
from asyncgraph.text import LLMCall

pytestmark = pytest.mark.anyio

BEST = with_instructions([INSTRUCTIONS["a"], INSTRUCTIONS["b"], INSTRUCTIONS["c"]])


def search_for(program: Module, model: Any, **options: Any) -> ParetoSearch:
    settings: dict[str, Any] = {"model": model, "max_calls": 600, "seed": 0, **options}
    return ParetoSearch(program, TRAIN, VAL, **settings)


async def test_finds_the_best_prompt_despite_conflicting_instructions() -> None:
    model = make_model()
    program = SkillProgram(model)
    search = search_for(program, model)
    result = await search.run()
    assert program.prompt.data == BEST  # loaded into the Module
    assert result.best.values == {"prompt": BEST}
    assert result.best_score == pytest.approx(accuracy(BEST, VAL)) == pytest.approx(9 / 11)
    assert accuracy(BASE, VAL) == 0
    # Greedy steps add a, b, c (one rewrite each) and one validation finds the best.
    assert search.best.origin == "proposal"
    first = next(row for row in result.history if row["best_score"] == result.best_score)
    assert first["calls"] < 100 and first["greedy"]
    assert not result.history[-1]["greedy"]  # then greedy stalled and the search widened


async def test_started_wide_it_finds_the_best_prompt_by_a_merge() -> None:
    model = make_model()
    program = SkillProgram(model)
    search = search_for(program, model, patience=0)
    result = await search.run()
    assert result.best.values == {"prompt": BEST}
    kinds = {w["kind"] for row in result.history for w in row["work"]}
    assert kinds == {"seed", "proposal", "merge"}
    assert search.best.origin == "merge"  # the best joins two lineages
    # The lowercase variant stays on the frontier: it is best on the two 'd' examples.
    assert len(result.frontier) == 2


async def test_same_seed_same_search_and_another_seed_differs() -> None:
    states = []
    for seed in (0, 0, 1):
        model = make_model()
        search = search_for(SkillProgram(model), model, seed=seed)
        await search.run()
        states.append(search.state_dict())
    assert states[0] == states[1]
    assert states[0]["history"] != states[2]["history"]


@pytest.mark.parametrize("patience", [2, 0])
async def test_deterministic_whatever_the_timing(patience: int) -> None:
    # Replies arrive in an order set by per-request latencies: the pool is the same.
    async def jittery(messages: list[dict[str, Any]]) -> str:
        await anyio.sleep((hash(json.dumps(messages)) % 5) / 1000)
        return respond(messages)

    plain = make_model()
    first = search_for(SkillProgram(plain), plain, max_calls=300, patience=patience)
    await first.run()
    slow = SimulatedModel(latency_s=0.0, responder=jittery, tag_replies=False)
    second = search_for(SkillProgram(slow), slow, max_calls=300, patience=patience)
    await second.run()
    assert first.state_dict() == second.state_dict()


async def test_resume_from_state_dict_ends_like_an_uninterrupted_run() -> None:
    model = make_model()
    whole = search_for(SkillProgram(model), model)
    expected = await whole.run()

    saved: list[dict[str, Any]] = []
    model = make_model()
    first = search_for(SkillProgram(model), model)
    for _ in range(3):  # the seed's round and two search rounds, then "interrupted"
        assert await first.step()
    saved.append(json.loads(json.dumps(first.state_dict())))

    model = make_model()
    program = SkillProgram(model)
    resumed = search_for(program, model)
    resumed.load_state_dict(saved[0])
    result = await resumed.run()
    assert resumed.state_dict() == whole.state_dict()
    assert result.best.values == expected.best.values and program.prompt.data == BEST
    assert (result.calls, result.tokens, result.rounds) == (
        expected.calls,
        expected.tokens,
        expected.rounds,
    )


async def test_load_state_dict_refuses_another_search() -> None:
    model = make_model()
    search = search_for(SkillProgram(model), model)
    await search.step()
    state = search.state_dict()
    other = search_for(SkillProgram(model), model, seed=5)
    with pytest.raises(ValueError, match="belongs to another search"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"expects ParetoSearch\.state_dict"):
        other.load_state_dict({"pool": []})


async def test_budget_in_calls_and_tokens_stops_the_search() -> None:
    for budget in ({"max_calls": 150}, {"max_tokens": 3000}):
        model = make_model()
        search = search_for(SkillProgram(model), model, **{"max_calls": None, **budget})
        result = await search.run()
        assert model.usage.snapshot().requests == result.calls  # every call is counted
        assert model.usage.snapshot().total_tokens == result.tokens
        spent, limit = (
            (result.calls, budget["max_calls"])
            if "max_calls" in budget
            else (result.tokens, budget["max_tokens"])
        )
        assert spent >= limit
        # Over by less than one round's worth: the last rounds shrink to what is left.
        per_round = spent / max(1, result.rounds - 1)
        assert spent - limit < per_round
        assert not await search.step()  # spent: nothing more runs


class SkewedProgram(SkillProgram):
    """Examples of the first skill cost 12 extra model calls each: work items cost
    unevenly (a minibatch of them costs far more than the average item)."""

    async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
        if example["skill"] == "a":
            for _ in range(12):  # answered, then dropped: no gradient flows through them
                await LLMCall.apply(Variable(BASE), Variable(example["question"]), model=self.model)
        return await super().forward(example)


@pytest.mark.parametrize("max_calls", [180, 260, 400, 650])
async def test_the_budget_is_overshot_by_at_most_one_work_item_with_skewed_costs(
    max_calls: int,
) -> None:
    model = make_model()
    search = search_for(SkewedProgram(model), model, max_calls=max_calls)
    result = await search.run()
    items = [item for row in result.history[1:] for item in row["work"]]
    costs = [item["calls"] for item in items]
    assert len(set(costs)) >= 2  # the items did cost unevenly
    assert sum(costs) + result.history[0]["calls"] == result.calls  # every call is an item's
    assert result.calls >= max_calls
    assert result.calls - max_calls <= max(costs), (result.calls, max_calls, costs)


@pytest.mark.parametrize("cap", [0.2, 0.6, 1.2])
async def test_a_cost_cap_stops_the_search_within_one_work_item(cap: float) -> None:
    model = SimulatedModel(
        latency_s=0.0, responder=respond, tag_replies=False, pricing=Pricing(15.0, 60.0)
    )
    search = search_for(SkillProgram(model), model, max_calls=None, max_cost_usd=cap)
    result = await search.run()
    assert result.cost_usd == pytest.approx(model.usage.snapshot().cost_usd)
    assert result.cost_usd >= cap and not await search.step()
    items = [item["cost_usd"] for row in result.history[1:] for item in row["work"]]
    assert result.cost_usd - cap <= max(items)
    restored = search_for(SkillProgram(model), model, max_calls=None, max_cost_usd=cap)
    restored.load_state_dict(json.loads(json.dumps(search.state_dict())))
    assert restored.cost_usd == pytest.approx(result.cost_usd) and restored.exhausted()


async def test_a_cost_cap_with_an_unpriced_model_is_an_error_after_the_seeds_evaluation() -> None:
    # Unlike a Job's cap, which looks for the models it can reach before its first call,
    # the search learns that a model is unpriced from its first calls (documented).
    model = make_model()
    model.pricing = None
    search = search_for(SkillProgram(model), model, max_calls=None, max_cost_usd=1.0)
    with pytest.raises(ModelConfigError, match="needs every call priced"):
        await search.step()  # the seed's evaluation
    assert search.round == 0


async def test_max_rounds() -> None:
    model = make_model()
    result = await search_for(SkillProgram(model), model, max_calls=None, max_rounds=2).run()
    assert result.rounds == 3 and [row["round"] for row in result.history] == [0, 1, 2]


def candidate(cid: int, scores: list[float], parents: tuple[int, ...] = ()) -> Candidate:
    return Candidate(cid, {"prompt": f"v{cid}"}, parents, "proposal", 0, scores)


def test_frontier_keeps_a_candidate_best_on_one_example_and_is_bounded() -> None:
    program = SkillProgram(make_model())
    search = ParetoSearch(program, TRAIN, VAL[:4], max_rounds=1, max_frontier=2)
    search.pool = [
        candidate(0, [0, 0, 0, 0]),
        candidate(1, [1, 1, 1, 0]),  # the best on average
        candidate(2, [0, 0, 0, 1]),  # worse on average, but alone best on one example
        candidate(3, [1, 1, 0, 0]),  # dominated by 1
        candidate(4, [1, 0, 0, 0.5]),  # best on one (a tie), better than 1 on another
    ]
    search.max_frontier = 8
    assert [(c.id, n) for c, n in search.frontier()] == [(1, 3), (2, 1), (4, 1)]
    search.max_frontier = 2  # the widest coverage stays, then the best mean
    assert [(c.id, n) for c, n in search.frontier()] == [(1, 3), (4, 1)]
    assert search.best.id == 1


async def test_merge_takes_what_each_changed_since_their_ancestor() -> None:
    class Two(Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = Parameter("f0", role="first")
            self.second = Parameter("s0", role="second")

        async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
            good = {"x": "f1", "y": "s1"}[example["k"]]
            hit = good in (self.first.data, self.second.data)
            return Variable("" if hit else "wrong"), float(hit)

    model = make_model()
    asked: list[Any] = []
    watcher = SimulatedModel(
        latency_s=0.0, responder=lambda m: asked.append(m) or "", tag_replies=False
    )
    examples = [{"k": "x"}, {"k": "y"}]
    search = ParetoSearch(Two(), examples, examples, model=watcher, max_rounds=1, proposals=1)
    seed = Candidate(0, {"first": "f0", "second": "s0"}, (), "seed", 0, [0, 0])
    a = Candidate(1, {"first": "f1", "second": "s0"}, (0,), "proposal", 1, [1, 0])
    b = Candidate(2, {"first": "f0", "second": "s1"}, (0,), "proposal", 1, [0, 1])
    search.pool = [seed, a, b]
    search.round = 2
    assert search._merge_pairs(search.frontier()) == [(1, 2)]
    search._limiter = anyio.CapacityLimiter(4)
    outcome = await search._merge(1, 2)
    assert outcome.child == {"first": "f1", "second": "s1"} and outcome.scores == [1, 1]
    assert asked == []  # each parameter changed on one side only: no model call
    del model


async def test_merge_asks_the_model_when_both_changed_one_parameter() -> None:
    model = make_model()
    search = search_for(SkillProgram(model), model)
    seed = Candidate(0, {"prompt": BASE}, (), "seed", 0, [0.0] * len(VAL))
    a_prompt = with_instructions([INSTRUCTIONS["a"]])
    b_prompt = with_instructions([INSTRUCTIONS["b"]])
    a = Candidate(
        1, {"prompt": a_prompt}, (0,), "proposal", 1, [accuracy(a_prompt, [r]) for r in VAL]
    )
    b = Candidate(
        2, {"prompt": b_prompt}, (0,), "proposal", 1, [accuracy(b_prompt, [r]) for r in VAL]
    )
    search.pool = [seed, a, b]
    search._limiter = anyio.CapacityLimiter(4)
    outcome = await search._merge(1, 2)
    merged = with_instructions([INSTRUCTIONS["a"], INSTRUCTIONS["b"]])
    assert outcome.child == {"prompt": merged}
    assert outcome.stages == ["merge", "validation (won examples)", "validation (rest)"]
    assert outcome.scores == [accuracy(merged, [r]) for r in VAL]


async def test_rounds_run_their_work_at_once_within_the_concurrency_limit() -> None:
    running = 0
    peak = 0

    async def counting(messages: list[dict[str, Any]]) -> str:
        nonlocal running, peak
        solver = str(messages[0]["content"]).startswith(BASE)  # a forward, not feedback
        if solver:
            running += 1
            peak = max(peak, running)
        await anyio.sleep(0.01)
        if solver:
            running -= 1
        return respond(messages)

    model = SimulatedModel(latency_s=0.0, responder=counting, tag_replies=False)
    search = search_for(SkillProgram(model), model, max_calls=None, max_rounds=2, max_concurrency=6)
    await search.run()
    assert peak == 6  # 4 proposals x 4 examples at once, held to the limit


def test_options_are_checked() -> None:
    model = make_model()
    program = SkillProgram(model)
    with pytest.raises(ValueError, match="needs a budget"):
        ParetoSearch(program, TRAIN, VAL)
    with pytest.raises(ValueError, match="proposals must be an int >= 1"):
        ParetoSearch(program, TRAIN, VAL, max_rounds=1, proposals=0)
    with pytest.raises(ValueError, match="non-empty train_set and val_set"):
        ParetoSearch(program, [], VAL, max_rounds=1)
    with pytest.raises(TypeError, match="searches a Module"):
        ParetoSearch([program.prompt], TRAIN, VAL, max_rounds=1)  # type: ignore[arg-type]


async def test_forward_must_return_a_loss_and_a_score() -> None:
    model = make_model()

    async def bad(program: Module, example: Mapping[str, Any]) -> Any:
        return "nope"

    search = search_for(SkillProgram(model), model, forward=bad)
    with pytest.raises(TypeError, match=r"\.loss \(a Variable\) and \.score"):
        await search.run()


async def test_the_searched_module_is_untouched_until_the_end() -> None:
    model = make_model()
    program = SkillProgram(model)
    search = search_for(program, model)
    for _ in range(6):
        await search.step()
    assert search.best.values["prompt"] != BASE  # a tip was validated
    assert program.prompt.data == BASE and program.prompt.grad is None
    search.finish()
    assert program.prompt.data == search.best.values["prompt"] != BASE


async def test_an_unreadable_rewrite_is_a_skipped_update_of_the_step() -> None:
    """A model that answers updates in prose (no tags, no structured outputs): the
    rewrite makes no child, and the step records it as TGD does (``search.skipped``, the
    history row's ``skipped_updates``); the module keeps its value."""

    def prose_updates(messages: list[dict[str, Any]]) -> str:
        if "IMPROVED_VARIABLE" in json.dumps(messages):
            return "Sure! Here is a better version of the prompt, in my own words."
        return str(respond(messages))

    model = SimulatedModel(latency_s=0.0, responder=prose_updates, tag_replies=False)
    program = SkillProgram(model)
    tgd_options = {"structured": False, "max_retries": 0}
    search = search_for(program, model, max_rounds=2, tgd_options=tgd_options)
    await search.step()  # the seed's evaluation
    assert search.skipped == [] and "skipped_updates" not in search.history[-1]
    await search.step()  # a greedy rewrite, unreadable
    assert [(s.role, s.attempts, s.structured) for s in search.skipped] == [
        ("system prompt", 1, False)
    ]
    assert search.skipped[0].reply.startswith("Sure! Here is a better version")
    (row,) = search.history[-1]["skipped_updates"]
    assert row["role"] == "system prompt" and row["attempts"] == 1
    assert "rewrite unreadable" in json.dumps(search.history[-1]["work"])
    assert program.prompt.data == BASE


async def test_strict_makes_an_unreadable_rewrite_or_merge_end_the_step() -> None:
    """``tgd_options={"strict": True}``: as ``TGD(strict=True)``, an unreadable rewrite or
    merge raises ``UpdateParseError`` (not a note of the round), and nothing is skipped."""

    def prose(messages: list[dict[str, Any]]) -> str:
        text = json.dumps(messages)
        if "VARIABLE_A" in text or "IMPROVED_VARIABLE" in text:
            return "Sure! Both look fine to me, in my own words."
        return str(respond(messages))

    model = SimulatedModel(latency_s=0.0, responder=prose, tag_replies=False)
    strict = {"structured": False, "max_retries": 0, "strict": True}
    program = SkillProgram(model)
    search = search_for(program, model, max_rounds=2, tgd_options=strict)
    await search.step()  # the seed's evaluation
    with pytest.raises(UpdateParseError) as rewrite:
        await search.step()
    assert rewrite.value.role == "system prompt" and program.prompt.data == BASE
    merging = search_for(SkillProgram(model), model, tgd_options=strict)
    seed = Candidate(0, {"prompt": BASE}, (), "seed", 0, [0.0] * len(VAL))
    a = Candidate(1, {"prompt": with_instructions([INSTRUCTIONS["a"]])}, (0,), "proposal", 1, [])
    b = Candidate(2, {"prompt": with_instructions([INSTRUCTIONS["b"]])}, (0,), "proposal", 1, [])
    merging.pool = [seed, a, b]
    merging._limiter = anyio.CapacityLimiter(4)
    with pytest.raises(UpdateParseError, match="could not read the merge") as merge:
        await merging._merge(1, 2)
    assert merge.value.reply.startswith("Sure! Both look fine")
    assert search.skipped == [] and merging.skipped == []


@pytest.mark.parametrize("json_schema", [True, False])
async def test_a_merge_is_asked_with_structured_outputs_where_the_server_takes_them(
    json_schema: bool,
) -> None:
    """A merge asked of a small local model (the llama.cpp fake: prose, no tags, JSON where
    a schema binds it) with ``structured="auto"``: the merged value comes back in
    ``merged_variable``; a server that refuses ``response_format`` is asked with the tags,
    which a small model ignores: the merge is a skipped update."""
    first = with_instructions([INSTRUCTIONS["a"]])
    second = with_instructions([INSTRUCTIONS["b"]])
    with LocalModelTestServer(json_schema=json_schema) as server:
        async with OpenAIChat("smollm2", base_url=server.url, api_key="") as model:
            merger = Merger(SkillProgram(model), lambda: model, {"structured": "auto"})
            merged = await merger.merge_text(model, "system prompt", first, second, BASE)
        formats = [r.body.get("response_format") for r in server.requests]
    assert formats[0]["json_schema"]["schema"]["required"] == ["merged_variable"]
    if json_schema:
        assert merged == f"{first} Be precise." and merger.skipped == []  # a's, improved
    else:
        assert formats[1:] == [None]  # asked once more, with the tags
        assert merged is None and [s.structured for s in merger.skipped] == [False]


async def test_an_unreadable_merge_is_a_skipped_update_too() -> None:
    def prose_merges(messages: list[dict[str, Any]]) -> str:
        if "VARIABLE_A" in json.dumps(messages):
            return "Both versions are good; I would keep them both."
        return str(respond(messages))

    model = SimulatedModel(latency_s=0.0, responder=prose_merges, tag_replies=False)
    search = search_for(SkillProgram(model), model, tgd_options={"structured": False})
    seed = Candidate(0, {"prompt": BASE}, (), "seed", 0, [0.0] * len(VAL))
    a = Candidate(1, {"prompt": with_instructions([INSTRUCTIONS["a"]])}, (0,), "proposal", 1, [])
    b = Candidate(2, {"prompt": with_instructions([INSTRUCTIONS["b"]])}, (0,), "proposal", 1, [])
    search.pool = [seed, a, b]
    search._limiter = anyio.CapacityLimiter(4)
    outcome = await search._merge(1, 2)
    assert outcome.child is None and outcome.note == "merge of 'prompt' unreadable"
    assert [(s.role, s.attempts, s.structured) for s in search.skipped] == [
        ("system prompt", 1, False)
    ]
    assert search.skipped[0].reply == "Both versions are good; I would keep them both."
