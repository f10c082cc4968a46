"""``step(closure)``, the warning for a parameter that got no feedback, and TGD's
``in_context_examples``."""

from __future__ import annotations

import warnings

import pytest
from optim_helpers import Script

from asyncgraph import Parameter, Variable, is_grad_enabled, no_grad
from asyncgraph.optim import SGD, TGD, NoFeedbackWarning

pytestmark = pytest.mark.anyio


# --- step(closure) ------------------------------------------------------------------------


async def test_tgd_step_runs_an_async_closure_and_returns_its_loss() -> None:
    script = Script()
    prompt = Parameter("p", role="prompt")
    tgd = TGD([prompt], model=script.model)
    seen: list[bool] = []

    async def closure() -> Variable:
        tgd.zero_grad()
        seen.append(is_grad_enabled())
        loss = prompt + " (judged)"
        await loss.backward(Variable("make it longer"))
        return loss

    with no_grad():  # the closure still records: step enables grad for it, as torch does
        loss = await tgd.step(closure)
    assert seen == [True]
    assert isinstance(loss, Variable) and loss.data == "p (judged)"
    assert prompt.data == "p+"  # updated from the feedback the closure's backward left


async def test_sgd_step_runs_a_sync_or_an_async_closure_and_returns_its_loss() -> None:
    w = Parameter(1.0, role="w")
    opt = SGD([w], lr=0.5)

    def sync_closure() -> float:  # a sync closure cannot await backward: it sets the grad
        opt.zero_grad()
        w.grad = Variable(2.0)
        return 7.0

    assert await opt.step(sync_closure) == 7.0
    assert w.data == 0.0

    async def async_closure() -> Variable:
        opt.zero_grad()
        loss = w + 2.0
        await loss.backward()
        return loss

    loss = await opt.step(async_closure)
    assert isinstance(loss, Variable) and loss.data == 2.0
    assert w.data == -0.5  # d(w + 2)/dw = 1, lr 0.5


async def test_step_without_a_closure_returns_none_and_a_bad_closure_is_refused() -> None:
    w = Parameter(1.0)
    w.grad = Variable(1.0)
    opt = SGD([w], lr=0.1)
    assert await opt.step() is None
    with pytest.raises(TypeError, match="closure must be a function that computes the loss"):
        await opt.step("loss")  # type: ignore[arg-type]


# --- a warning when a parameter got no feedback ---------------------------------------------


async def test_a_parameter_without_feedback_warns_once_per_step() -> None:
    script = Script()
    used = Parameter("used", role="used prompt")
    unused = Parameter("unused", role="forgotten prompt")
    frozen = Parameter("frozen", role="frozen prompt", requires_grad=False)
    tgd = TGD([used, unused, frozen], model=script.model)
    for step in range(2):
        used.grad = Variable(f"feedback {step}")
        with pytest.warns(NoFeedbackWarning) as warned:
            await tgd.step()
        # One warning per step, for the one parameter that can get feedback and got none;
        # it points at the line that called step().
        assert len(warned) == 1
        message = str(warned[0].message)
        assert message.startswith(
            "TGD.step(): parameter 1 ('forgotten prompt') received no feedback in the last "
            "backward, so it was not updated."
        )
        assert "outside no_grad()" in message and "zero_grad()" in message
        assert warned[0].filename == __file__
        tgd.zero_grad()
    assert (used.data, unused.data) == ("used++", "unused")


async def test_sgd_warns_too_and_nothing_is_said_when_every_parameter_has_a_gradient() -> None:
    a, b = Parameter(1.0, role="a"), Parameter(2.0, role="b")
    opt = SGD([a, b], lr=1.0)
    a.grad = Variable(1.0)
    with pytest.warns(NoFeedbackWarning, match=r"SGD.step\(\): parameter 1 \('b'\)"):
        await opt.step()
    b.grad = Variable(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await opt.step()
    assert (a.data, b.data) == (-1.0, 1.0)


# --- in_context_examples ----------------------------------------------------------------------


async def test_in_context_examples_are_shown_in_every_update_request() -> None:
    script = Script()
    a = Parameter("a", role="first prompt")
    b = Parameter("b", role="second prompt")
    c = Parameter("c", role="third prompt")
    tgd = TGD(
        [{"params": [a, b]}, {"params": [c], "in_context_examples": ["Own example."]}],
        model=script.model,
        in_context_examples=["Answer: 42", "Answer: 7"],
    )
    for p in (a, b, c):
        p.grad = Variable("fb")
    await tgd.step()
    requests = {r.split("<ROLE>")[1].split("</ROLE>")[0]: r for r in script.contents()}
    shared = "<EXAMPLES>\n<EXAMPLE>\nAnswer: 42\n</EXAMPLE>\n<EXAMPLE>\nAnswer: 7\n</EXAMPLE>\n</EXAMPLES>"
    assert shared in requests["the first prompt"] and shared in requests["the second prompt"]
    assert "<EXAMPLE>\nOwn example.\n</EXAMPLE>" in requests["the third prompt"]
    assert "Answer: 42" not in requests["the third prompt"]
    # The group's own examples are part of its options (and of state_dict); the
    # optimizer-wide ones are configuration, like the model.
    groups = tgd.state_dict()["param_groups"]
    assert "in_context_examples" not in groups[0]
    assert groups[1]["in_context_examples"] == ["Own example."]


async def test_without_examples_the_request_has_no_examples_section() -> None:
    script = Script()
    p = Parameter("a", role="prompt")
    p.grad = Variable("fb")
    await TGD([p], model=script.model).step()
    assert "<EXAMPLES>" not in script.contents()[0]


def test_in_context_examples_must_be_texts() -> None:
    p = Parameter("a")
    with pytest.raises(TypeError, match=r"in_context_examples must be a list of str.*wrap it"):
        TGD([p], model="simulated", in_context_examples="one example")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="in_context_examples must be a list of str"):
        TGD([{"params": [p], "in_context_examples": [1]}], model="simulated")
