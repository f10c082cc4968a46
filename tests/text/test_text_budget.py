"""Feedback budgets: a node whose feedback overflows its budget condenses it first.

The proof scenario of TextGrad issues #93/#179: one intermediate text (a plan) read by
200 judges. Every backward request stays within the budget, the condensed feedback
still names every distinct complaint, and the same graph gives the same requests and
gradients on every run.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from text_helpers import Recorder

from asyncgraph import Parameter, Variable, backward
from asyncgraph.text import (
    LLMCall,
    PythonCall,
    TextLoss,
    approx_tokens,
    render_feedback,
    set_feedback_budget,
    use_feedback_budget,
)
from asyncgraph.text._budget import DEFAULT_FEEDBACK_BUDGET, current_feedback_budget

pytestmark = pytest.mark.anyio

COMPLAINTS = [f"C{k}" for k in range(7)]
FEEDBACK_TAGS = ("OUTPUT_FEEDBACK", "FEEDBACK")
BUDGET = 600


def _feedback_in(content: str) -> str:
    for tag in FEEDBACK_TAGS:
        match = re.search(rf"<{tag}>\n(.*?)\n</{tag}>", content, re.DOTALL)
        if match:
            return match[1]
    return ""


def judge_responder(messages: list[dict[str, Any]]) -> str:
    """Judges complain (complaint k = judge % 7, with a long explanation); summaries keep
    each distinct complaint once, in order of first appearance; other requests echo."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    content = messages[-1]["content"]
    if system.startswith("You condense feedback"):
        seen = list(dict.fromkeys(re.findall(r"\bC\d\b", _feedback_in(content))))
        return "; ".join(f"{c}: fix it" for c in seen)
    judge = re.search(r"You are judge (\d+)", content)
    if "<VARIABLE>" in content and judge and not _feedback_in(content):
        k = int(judge[1]) % len(COMPLAINTS)  # a judge's loss: its complaint
        return f"{COMPLAINTS[k]}: the plan " + "misses a required step and " * 6 + "must say so."
    if "<VARIABLE>" in content:  # a feedback request: pass on what reached the node
        found = list(dict.fromkeys(re.findall(r"\bC\d\b", _feedback_in(content))))
        return "plan needs " + ", ".join(found) if found else "no change"
    return "a plan"


async def run_scenario(budget: int | None) -> tuple[Recorder, Parameter]:
    rec = Recorder(judge_responder)
    prompt = Parameter("Plan the migration.", role="planner prompt")
    plan = await LLMCall.apply(
        prompt,
        Variable("migrate the database", role="task"),
        model=rec.model,
        role="plan",
        feedback_budget=budget,
    )
    losses = []
    for i in range(200):
        judge = TextLoss(f"You are judge {i}. Criticise the plan.", model=rec.model)
        losses.append(await judge(plan))
    await backward(losses)
    return rec, prompt


async def test_two_hundred_judges_stay_within_the_budget_and_keep_every_complaint() -> None:
    rec, prompt = await run_scenario(BUDGET)
    summaries = [m for m in rec.requests if m[0]["content"].startswith("You condense feedback")]
    assert len(summaries) > 1  # map-reduce: several chunks, then a final summary
    for messages in rec.requests:
        assert approx_tokens(_feedback_in(messages[-1]["content"])) <= BUDGET
    grad = render_feedback(prompt.grad)
    assert (
        grad.startswith("[built from condensed feedback: 200 feedback entries (about ")
        and f"budget of {BUDGET} tokens]" in grad
    )
    assert grad.endswith("plan needs " + ", ".join(COMPLAINTS))
    about = re.search(r"\(about (\d+) tokens\)", grad)
    assert about is not None and int(about[1]) > 4 * BUDGET  # far over budget, condensed


async def test_condensing_is_deterministic() -> None:
    first, p1 = await run_scenario(BUDGET)
    second, p2 = await run_scenario(BUDGET)
    assert p1.grad is not None and p2.grad is not None
    assert p1.grad.data == p2.grad.data
    assert sorted(str(m) for m in first.requests) == sorted(str(m) for m in second.requests)


async def test_no_budget_sends_everything_and_condenses_nothing() -> None:
    rec, prompt = await run_scenario(None)
    assert not [m for m in rec.requests if m[0]["content"].startswith("You condense")]
    assert not render_feedback(prompt.grad).startswith("[built from condensed")
    biggest = max(approx_tokens(_feedback_in(m[-1]["content"])) for m in rec.requests)
    assert biggest > 4 * BUDGET


async def test_feedback_within_the_budget_is_sent_as_is() -> None:
    rec, prompt = await run_scenario(100_000)
    assert not [m for m in rec.requests if m[0]["content"].startswith("You condense")]
    assert render_feedback(prompt.grad) == "plan needs " + ", ".join(COMPLAINTS)


async def test_the_budget_is_scoped_per_task_and_read_at_the_forward() -> None:
    assert current_feedback_budget() == DEFAULT_FEEDBACK_BUDGET
    with use_feedback_budget(BUDGET):
        assert current_feedback_budget() == BUDGET
        rec = Recorder(judge_responder)
        prompt = Parameter("Plan.", role="planner prompt")
        plan = await LLMCall.apply(prompt, "task", model=rec.model, role="plan")
        with use_feedback_budget(None):
            assert current_feedback_budget() is None
        assert current_feedback_budget(123) == 123  # an explicit value wins
    assert current_feedback_budget() == DEFAULT_FEEDBACK_BUDGET
    # Outside the block, the node still has the budget it was built with.
    losses = [
        await TextLoss(f"You are judge {i}. Criticise the plan.", model=rec.model)(plan)
        for i in range(60)
    ]
    await backward(losses)
    assert render_feedback(prompt.grad).startswith("[built from condensed feedback: 60")


async def test_process_default_and_bad_budgets() -> None:
    try:
        set_feedback_budget(77)
        assert current_feedback_budget() == 77
        with use_feedback_budget(88):
            assert current_feedback_budget() == 88
    finally:
        set_feedback_budget(DEFAULT_FEEDBACK_BUDGET)
    for bad in (0, -5, 2.5, "100", True):
        with pytest.raises(TypeError, match="feedback budget is an int >= 1"):
            use_feedback_budget(bad).__enter__()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LLMCall: a feedback budget"):
        await LLMCall.apply("s", "x", model=Recorder().model, feedback_budget=0)


async def test_a_python_function_node_condenses_too() -> None:
    rec = Recorder(judge_responder)
    text = Variable("draft", role="draft", requires_grad=True)
    shouted = await PythonCall.apply(
        str.upper,
        text,
        purpose="Upper-cases the draft.",
        feedback_model=rec.model,
        feedback_budget=BUDGET,
    )
    losses = [
        await TextLoss(f"You are judge {i}. Criticise the plan.", model=rec.model)(shouted)
        for i in range(100)
    ]
    await backward(losses)
    assert render_feedback(text.grad).startswith("[built from condensed feedback: 100")
    for messages in rec.requests:
        assert approx_tokens(_feedback_in(messages[-1]["content"])) <= BUDGET


async def test_no_feedback_condenses_to_nothing_without_a_call() -> None:
    from asyncgraph.text import condense_feedback

    async def ask(messages: object) -> str:
        raise AssertionError("no model call for no feedback")

    assert await condense_feedback([], budget=100, role="system prompt", ask=ask) == ""
