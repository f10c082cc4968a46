"""Default models: ``use_models`` (per task) and ``set_default_models`` (per process).

Precedence, per option: the call's argument > the innermost ``use_models`` that sets
it > ``set_default_models`` > the behaviour without defaults (feedback model = the
call's model, feedback params = its params; no model at all is an error).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from text_helpers import NamedModel

from asyncgraph import Parameter, Variable
from asyncgraph.optim import TGD
from asyncgraph.text import (
    TextLoss,
    current_models,
    feedback_defaults,
    llm_call,
    python_call,
    set_default_models,
    use_models,
)
from asyncgraph.text._defaults import ModelDefaults
from asyncgraph.text._registry import ModelRef

pytestmark = pytest.mark.anyio

Log = list[tuple[str, dict[str, Any], list[dict[str, Any]]]]


@pytest.fixture(autouse=True)
def no_process_default() -> Iterator[None]:
    previous = set_default_models()
    yield
    set_default_models(
        previous.model,
        base_url=previous.base_url,
        params=previous.params,
        feedback_model=previous.feedback_model,
        feedback_params=previous.feedback_params,
    )


@pytest.fixture
def log() -> Log:
    return []


def models(log: Log, *names: str) -> list[NamedModel]:
    return [NamedModel(name, log) for name in names]


def _kind(messages: list[dict[str, Any]]) -> str:
    content = messages[-1]["content"]
    if "IMPROVED_VARIABLE" in content:
        return "update"
    return "feedback" if "<VARIABLE>" in content else "forward"


def calls(log: Log) -> list[tuple[str, dict[str, Any], str]]:
    """(model, params, kind) of every request: kind is 'forward', 'feedback' or 'update'."""
    return [(name, params, _kind(messages)) for name, params, messages in log]


async def test_without_any_model_the_error_says_how_to_set_one() -> None:
    with pytest.raises(TypeError) as info:
        await llm_call("sys", "question")
    message = str(info.value)
    assert "LLMCall needs a model and none is set: pass model=" in message
    assert "use_models(model=...)" in message and "set_default_models(model=...)" in message
    with pytest.raises(TypeError, match="FormattedLLMCall needs a model"):
        await TextLoss("Judge it.", template="{a}")(a="x")
    with pytest.raises(TypeError, match="PythonCall needs a feedback model and none is set"):
        await python_call(str.upper, Parameter("x"), purpose="Upper-cases the text.")
    tgd = TGD([Parameter("x", role="prompt")])
    tgd.params[0].grad = Variable("feedback")
    with pytest.raises(TypeError, match="TGD needs a feedback model"):
        await tgd.step()


async def test_use_models_sets_the_model_and_the_feedback_falls_back_to_it(log: Log) -> None:
    (forward,) = models(log, "A")
    prompt = Parameter("sys", role="system prompt")
    with use_models(forward, params={"temperature": 0}) as effective:
        assert effective.model is forward and effective.params == {"temperature": 0}
        answer = await llm_call(prompt, "question", role="answer")
    await answer.backward("too long")
    assert calls(log) == [
        ("A", {"temperature": 0}, "forward"),
        ("A", {"temperature": 0}, "feedback"),
    ]
    assert prompt.grad is not None and prompt.grad.data.startswith("A: fix the system prompt")


async def test_every_option_has_its_default(log: Log) -> None:
    forward, feedback = models(log, "A", "B")
    prompt = Parameter("sys", role="system prompt")
    with use_models(forward, params={"t": 1}, feedback_model=feedback, feedback_params={"t": 0}):
        answer = await llm_call(prompt, "question", role="answer")
        loss = await TextLoss("Judge the answer.")(answer)
        await loss.backward()
        tgd = TGD([prompt])
        await tgd.step()
    assert calls(log) == [
        ("A", {"t": 1}, "forward"),  # the answer
        ("A", {"t": 1}, "forward"),  # the judge
        ("B", {"t": 0}, "feedback"),  # on the answer, from the judge's node
        ("B", {"t": 0}, "feedback"),  # on the prompt, from the answer's node
        ("B", {"t": 0}, "update"),  # TGD's request
    ]
    assert prompt.data == "edited by B"


async def test_an_explicit_argument_beats_the_scope(log: Log) -> None:
    scoped, explicit, feedback = models(log, "scoped", "explicit", "feedback")
    prompt = Parameter("sys", role="system prompt")
    with use_models(scoped, params={"t": 1}, feedback_model=feedback):
        answer = await llm_call(prompt, "q", model=explicit, params={"t": 2})
        other = await llm_call(prompt, "q", feedback_model=explicit, feedback_params={"t": 3})
    await answer.backward("fb")
    await other.backward("fb")
    assert calls(log) == [
        ("explicit", {"t": 2}, "forward"),
        ("scoped", {"t": 1}, "forward"),
        ("feedback", {"t": 2}, "feedback"),  # the scope's feedback model, the call's params
        ("explicit", {"t": 3}, "feedback"),
    ]


async def test_the_innermost_scope_wins_per_option(log: Log) -> None:
    outer, inner, feedback = models(log, "outer", "inner", "feedback")
    with use_models(outer, feedback_model=feedback, params={"t": 1}):
        with use_models(inner):
            defaults = current_models()
            assert (defaults.model, defaults.feedback_model) == (inner, feedback)
            assert defaults.params == {"t": 1}
            answer = await llm_call(Parameter("sys"), "q")
        assert current_models().model is outer
    assert current_models() == ModelDefaults()
    await answer.backward("fb")
    assert calls(log) == [("inner", {"t": 1}, "forward"), ("feedback", {"t": 1}, "feedback")]


async def test_a_scope_beats_the_process_default_and_the_process_default_applies_outside(
    log: Log,
) -> None:
    process, scoped, feedback = models(log, "process", "scoped", "feedback")
    assert set_default_models(process, feedback_model=feedback) == ModelDefaults()
    with use_models(scoped):
        await llm_call("sys", "q")
        assert current_models().feedback_model is feedback  # from the process default
    await llm_call("sys", "q")
    previous = set_default_models()
    assert previous.model is process and previous.feedback_model is feedback
    assert current_models() == ModelDefaults()
    assert [name for name, _, _ in log] == ["scoped", "process"]
    with pytest.raises(TypeError, match="needs a model"):
        await llm_call("sys", "q")


async def test_a_base_url_goes_only_with_its_model() -> None:
    with use_models("openai:gpt-test", base_url="http://127.0.0.1:9/v1"):
        with use_models("simulated:0"):
            assert current_models().base_url is None
            answer = await llm_call(Parameter("sys"), "q")
        assert current_models().base_url == "http://127.0.0.1:9/v1"
    node = answer.grad_fn
    assert node is not None and node.ctx.options.model == ModelRef("simulated:0", None)


async def test_scopes_do_not_leak_between_tasks(log: Log) -> None:
    a, b = models(log, "A", "B")
    entered, done = anyio.Event(), anyio.Event()
    seen: dict[str, Any] = {}

    async def first() -> None:
        with use_models(a):
            entered.set()
            await done.wait()  # the other task runs its scope inside this one's lifetime
            seen["first"] = current_models().model
            await llm_call("sys", "q1")

    async def second() -> None:
        await entered.wait()
        seen["second before"] = current_models().model
        with use_models(b):
            seen["second"] = current_models().model
            await llm_call("sys", "q2")
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    assert seen == {"first": a, "second before": None, "second": b}
    assert sorted(name for name, _, _ in log) == ["A", "B"]


async def test_tasks_started_inside_a_scope_inherit_it(log: Log) -> None:
    (a,) = models(log, "A")
    with use_models(a):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(llm_call, "sys", f"q{i}")
    assert [name for name, _, _ in log] == ["A", "A", "A"]


async def test_the_backward_uses_the_models_of_the_forward_outside_the_scope(log: Log) -> None:
    forward, feedback, later = models(log, "forward", "feedback", "later")
    prompt = Parameter("sys", role="system prompt")
    with use_models(forward, feedback_model=feedback):
        answer = await llm_call(prompt, "q")
    with use_models(later, feedback_model=later):
        await answer.backward("fb")
    assert [name for name, _, _ in log] == ["forward", "feedback"]


async def test_tgd_reads_the_defaults_when_it_steps(log: Log) -> None:
    a, b = models(log, "A", "B")
    prompt = Parameter("sys", role="system prompt")
    tgd = TGD([prompt], model_params={"t": 9})
    prompt.grad = Variable("be shorter")
    with use_models(a, feedback_model=b, feedback_params={"t": 0}):
        await tgd.step()
    assert calls(log) == [("B", {"t": 9}, "update")]
    assert prompt.data == "edited by B"


def test_bad_defaults_fail_when_set() -> None:
    with pytest.raises(TypeError, match="must be a ChatModel"):
        with use_models(42):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match=r"base_url=.* goes with a model spec; pass model= too"):
        set_default_models(base_url="http://x")
    with pytest.raises(TypeError, match="params must be a dict"):
        set_default_models("simulated", params=["t"])  # type: ignore[arg-type]
    assert current_models() == ModelDefaults()


def test_feedback_defaults_for_functions_of_your_own() -> None:
    with pytest.raises(TypeError, match="MyFunction needs a feedback model"):
        feedback_defaults("MyFunction")
    with use_models("simulated", base_url=None, params={"t": 1}):
        assert feedback_defaults("MyFunction") == ("simulated", None, {"t": 1})
        assert feedback_defaults("MyFunction", "openai:x", {"t": 2}) == ("openai:x", None, {"t": 2})
        with use_models(feedback_model="judge", feedback_params={"t": 0}):
            assert feedback_defaults("MyFunction") == ("judge", None, {"t": 0})
