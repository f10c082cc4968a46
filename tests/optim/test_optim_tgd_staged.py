"""``TGD(staged=True)``: each update starts inside backward when its feedback is final,
and is applied by ``step()`` only if the pass committed that very feedback."""

from __future__ import annotations

import warnings
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from optim_helpers import Script, improve

from asyncgraph import BackwardError, Function, Parameter, Variable
from asyncgraph.models import ModelResponseError
from asyncgraph.optim import TGD, NoFeedbackWarning

pytestmark = pytest.mark.anyio


class Stage(Function):
    """One stage of a text pipeline: ``out = upstream + param``. Its backward waits for
    ``ctx.gate`` (an Event, or None), then sends ``"fix <role>"`` to its parameter and the
    feedback it got on to its upstream stage; ``fail=True`` raises instead."""

    @staticmethod
    def forward(
        ctx: Any, param: Variable, upstream: Variable | None, gate: Any, fail: bool = False
    ) -> Variable:
        ctx.role, ctx.gate, ctx.fail = param.role, gate, fail
        before = "" if upstream is None else f"{upstream.data} | "
        return Variable(f"{before}{param.data}", role=f"output of {param.role}")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        if ctx.gate is not None:
            await ctx.gate.wait()
        await anyio.lowlevel.checkpoint()
        if ctx.fail:
            raise RuntimeError(f"stage {ctx.role} failed")
        upstream = g if ctx.needs_input_grad[1] else None
        return Variable(f"fix {ctx.role}"), upstream, None, None


def pipeline(params: list[Parameter], gates: list[Any], fail_first: bool = False) -> Variable:
    out: Variable | None = None
    for i, (p, gate) in enumerate(zip(params, gates, strict=True)):
        out = Stage.apply(p, out, gate, fail_first and i == 0)
    assert out is not None
    return out


def three() -> list[Parameter]:
    return [Parameter(f"v{i}", role=f"p{i}") for i in (1, 2, 3)]


async def test_updates_start_while_backward_runs_and_step_applies_them() -> None:
    # The last stage's parameter (p3) gets its feedback first; the first stage's backward
    # waits until p3's update request has reached the model: the pass can only finish
    # if that update started inside the backward.
    p3_asked = anyio.Event()

    def respond(messages: list[dict[str, Any]]) -> str:
        if "<VARIABLE>v3</VARIABLE>" in messages[1]["content"]:
            p3_asked.set()
        return improve(messages)

    script = Script(respond)
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    loss = pipeline(params, [p3_asked, None, None])
    with anyio.fail_after(60):
        await loss.backward()
    assert len(script.requests) == 3  # every update already ran, inside the backward
    assert [p.data for p in params] == ["v1", "v2", "v3"]  # staged, not applied
    await tgd.step()
    assert [p.data for p in params] == ["v1+", "v2+", "v3+"]
    assert len(script.requests) == 3  # step sent nothing more
    assert all(tgd.state[p] == {"step": 1} for p in params)


async def test_staged_and_plain_steps_give_the_same_values_and_requests() -> None:
    results = []
    for staged in (False, True):
        script = Script()
        params = three()
        tgd = TGD(params, model=script.model, staged=staged, momentum=1)
        for _ in range(2):
            tgd.zero_grad()
            await pipeline(params, [None, None, None]).backward()
            await tgd.step()
        contents = sorted(r[1]["content"] for r in script.requests)
        results.append(([p.data for p in params], contents))
    assert results[0] == results[1]
    assert results[1][0] == ["v1++", "v2++", "v3++"]


async def test_a_failed_pass_discards_what_it_staged() -> None:
    script = Script()
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    # The first stage fails after p3 and p2 have their feedback (and staged updates).
    loss = pipeline(params, [None, None, None], fail_first=True)
    with pytest.raises(BackwardError, match="stage p1 failed"):
        await loss.backward()
    assert all(p.grad is None for p in params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoFeedbackWarning)
        await tgd.step()
    assert [p.data for p in params] == ["v1", "v2", "v3"]  # nothing applied
    # The next, successful pass updates every parameter from its own feedback.
    asked = len(script.requests)
    tgd.zero_grad()
    await pipeline(params, [None, None, None]).backward()
    await tgd.step()
    assert [p.data for p in params] == ["v1+", "v2+", "v3+"]
    assert len(script.requests) == asked + 3


async def test_an_update_error_is_raised_by_step_and_changes_nothing() -> None:
    def respond(messages: list[dict[str, Any]]) -> str:
        if "<VARIABLE>v2</VARIABLE>" in messages[1]["content"]:
            raise ModelResponseError("the optimizer model is down")
        return improve(messages)

    script = Script(respond)
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    await pipeline(params, [None, None, None]).backward()  # the backward itself succeeds
    assert all(p.grad is not None for p in params)
    with pytest.raises(ModelResponseError, match="down"):
        await tgd.step()
    assert [p.data for p in params] == ["v1", "v2", "v3"]


async def test_feedback_added_to_an_older_gradient_is_updated_by_step() -> None:
    script = Script()
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    params[0].grad = Variable("earlier feedback")
    await pipeline(params, [None, None, None]).backward()
    assert len(script.requests) == 2  # p1 had a gradient already: not staged
    await tgd.step()
    assert [p.data for p in params] == ["v1+", "v2+", "v3+"]
    (p1_request,) = [r for r in script.requests if "<VARIABLE>v1</VARIABLE>" in r[1]["content"]]
    assert "earlier feedback" in p1_request[1]["content"] and "fix p1" in p1_request[1]["content"]


async def test_a_value_changed_after_backward_is_updated_afresh() -> None:
    script = Script()
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    await pipeline(params, [None, None, None]).backward()
    params[1].data = "w2"
    await tgd.step()
    assert [p.data for p in params] == ["v1+", "w2+", "v3+"]


async def test_remove_hooks_stops_staging() -> None:
    script = Script()
    params = three()
    tgd = TGD(params, model=script.model, staged=True)
    tgd.remove_hooks()
    await pipeline(params, [None, None, None]).backward()
    assert script.requests == []
    await tgd.step()
    assert [p.data for p in params] == ["v1+", "v2+", "v3+"]
