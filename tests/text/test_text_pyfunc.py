"""``PythonCall`` (a Python function in a text graph) and ``DeterministicEvaluator``
(a metric whose explanation is the feedback), in-process and on a worker."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from text_helpers import Recorder, RemoteAdd, RemoteEvaluator, remote_executor

from asyncgraph import Parameter, Variable, no_grad
from asyncgraph.models import SimulatedModel
from asyncgraph.optim import TGD
from asyncgraph.text import (
    DeterministicEvaluator,
    PythonCall,
    check_portable,
    deterministic_evaluator,
    llm_call,
    python_call,
    use_models,
)

pytestmark = pytest.mark.anyio

SPEC = "simulated:0"
INPUT = re.compile(r"<INPUT role='(.*?)'>\n(.*?)\n</INPUT>", re.DOTALL)


def join_words(first: str, second: str, *, separator: str = " ") -> str:
    return f"{first}{separator}{second}"


async def shout(text: str) -> str:
    await anyio.lowlevel.checkpoint()
    return text.upper()


async def test_forward_runs_the_function_on_the_data(recorder: Recorder) -> None:
    a = Parameter("hello", role="greeting")
    out = await python_call(
        join_words, a, "world", purpose="Joins two words.", separator="-", feedback_model=SPEC
    )
    assert out.data == "hello-world" and out.role == "output of join_words"
    assert out.grad_fn is not None and out.grad_fn.name == "PythonCall"
    loud = await python_call(
        shout, a, purpose="Upper-cases the text.", role="shouted greeting", feedback_model=SPEC
    )
    assert loud.data == "HELLO" and loud.role == "shouted greeting"
    count = await PythonCall.apply(len, a, purpose="Counts characters.", feedback_model=SPEC)
    assert count.data == 5
    assert recorder.requests == []  # no model call in a forward


async def test_backward_asks_the_feedback_model_about_each_input(recorder: Recorder) -> None:
    first = Parameter("hello", role="greeting")
    second = Parameter("world", role="name")
    out = await PythonCall.apply(
        join_words,
        first,
        "constant",
        purpose="Joins two words with a separator.",
        feedback_model=recorder.model,
        role="joined text",
        separator=second,  # a named input, after an option
    )
    assert out.data == "hello" + "world" + "constant"
    await out.backward(Variable("too long"))
    assert first.grad is not None and second.grad is not None
    assert first.grad.data == "fix the greeting for the joined text"
    assert first.grad.role == "feedback on the greeting"
    assert second.grad.data == "fix the name for the joined text"
    requests = recorder.feedback_requests()
    assert len(requests) == 2
    text = next(r for r in requests if "<ROLE>the greeting</ROLE>" in r)
    assert "<FUNCTION_PURPOSE>\nJoins two words with a separator.\n</FUNCTION_PURPOSE>" in text
    assert INPUT.findall(text) == [
        ("the greeting", "hello"),
        ("the input 2", "constant"),
        ("the name", "world"),
    ]
    assert "<FUNCTION_OUTPUT>\nhelloworldconstant\n</FUNCTION_OUTPUT>" in text
    assert "<OUTPUT_FEEDBACK>\ntoo long\n</OUTPUT_FEEDBACK>" in text
    assert "<VARIABLE>hello</VARIABLE>" in text
    assert recorder.requests[0][0]["content"].startswith("You are the feedback engine")


async def test_no_feedback_on_the_output_makes_the_output_the_objective(
    recorder: Recorder,
) -> None:
    a = Parameter("x", role="text")
    out = await python_call(shout, a, purpose="Upper-cases.", feedback_model=recorder.model)
    await out.backward()
    (request,) = recorder.feedback_requests()
    assert "No feedback was given on the output" in request


async def test_an_input_used_twice_gets_feedback_once(recorder: Recorder) -> None:
    a = Parameter("x", role="word")
    out = await python_call(join_words, a, a, purpose="Joins.", feedback_model=recorder.model)
    await out.backward(Variable("fb"))
    assert a.grad is not None and a.grad.data == "fix the word for the output of join_words"
    assert len(recorder.feedback_requests()) == 1


async def test_the_feedback_model_comes_from_the_defaults_of_the_forward(
    recorder: Recorder,
) -> None:
    a = Parameter("x", role="word")
    with use_models(feedback_model=recorder.model, feedback_params={"temperature": 0}):
        out = await python_call(shout, a, purpose="Upper-cases.")
    await out.backward(Variable("fb"))
    assert a.grad is not None and a.grad.data == "fix the word for the output of shout"


async def test_without_grad_no_model_is_needed() -> None:
    out = await python_call(shout, Variable("x"), purpose="Upper-cases.")
    assert out.data == "X" and out.grad_fn is None
    with no_grad():
        out = await python_call(shout, Parameter("y"), purpose="Upper-cases.")
    assert out.data == "Y" and out.grad_fn is None


async def test_python_call_errors_are_clear() -> None:
    with pytest.raises(TypeError, match=r"needs purpose=: a sentence saying what the function"):
        await PythonCall.apply(shout, Variable("x"))
    with pytest.raises(TypeError, match="fn must be callable"):
        await PythonCall.apply("not a function", Variable("x"), purpose="p")
    with pytest.raises(TypeError, match="Variable data must be"):
        await python_call(lambda t: object(), Variable("x"), purpose="Returns junk.")
    with pytest.raises(ZeroDivisionError):
        await python_call(lambda t: 1 / 0, Variable("x"), purpose="Fails.")


def exact(prediction: str, target: str) -> tuple[float, str]:
    if prediction.strip() == target:
        return 1.0, ""
    return 0.0, f"The answer must be exactly {target!r}, not {prediction!r}."


async def test_the_explanation_is_the_feedback() -> None:
    answer = Parameter("41", role="answer")
    score, loss = await deterministic_evaluator(exact, answer, "42")
    assert (
        score.data == 0.0
        and score.grad_fn is None
        and score.role == "score of the evaluation of the answer"
    )
    assert loss.data == "The answer must be exactly '42', not '41'."
    assert loss.role == "evaluation of the answer"
    await loss.backward()
    assert answer.grad is not None and answer.grad.data == loss.data
    assert answer.grad.role == "feedback on the answer"


async def test_a_correct_prediction_sends_no_feedback() -> None:
    answer = Parameter("42", role="answer")
    score, loss = await DeterministicEvaluator.apply(exact, answer, "42")
    assert (score.data, loss.data) == (1.0, "")
    await loss.backward()
    assert answer.grad is None


async def test_feedback_on_the_explanation_itself_is_appended() -> None:
    answer = Parameter("41", role="answer")
    _, loss = await deterministic_evaluator(exact, answer, "42", role="grading")
    await loss.backward(Variable("Also keep it short."))
    assert answer.grad is not None
    assert answer.grad.data == [loss.data, "Also keep it short."]


async def test_an_async_metric_and_evaluator_errors() -> None:
    async def contains(prediction: str, target: str) -> tuple[float, None]:
        return float(target in prediction), None

    score, loss = await deterministic_evaluator(contains, Parameter("a 42 b"), "42")
    assert (score.data, loss.data) == (1.0, "")
    with pytest.raises(TypeError, match=r"must return \(score, explanation\)"):
        await deterministic_evaluator(lambda p: 1.0, Parameter("x"))
    with pytest.raises(TypeError, match=r"explanation .* must be a str"):
        await deterministic_evaluator(lambda p: (1.0, 3), Parameter("x"))


# --- An exact-match metric drives TGD, no LLM judge -------------------------------------

RULE = "Answer with digits only."


def solver(messages: list[dict[str, Any]]) -> str:
    """Scripted: answers in digits when the system prompt holds RULE; rewrites from feedback."""
    content = messages[-1]["content"]
    if "IMPROVED_VARIABLE" in content:
        current = re.findall(r"<VARIABLE>(.*?)</VARIABLE>", content, re.DOTALL)[-1]
        return f"<IMPROVED_VARIABLE>{current} {RULE}</IMPROVED_VARIABLE>"
    if "<VARIABLE>" in content:  # feedback on the prompt, given the metric's explanation
        return f"Add the rule: {RULE}" if "exactly" in content else "Fine."
    number = {"six times seven": "42", "two plus two": "4"}[content]
    return number if RULE in messages[0]["content"] else f"The answer is {number}."


async def test_an_exact_match_metric_drives_tgd() -> None:
    model = SimulatedModel(latency_s=0, responder=solver, tag_replies=False)
    prompt = Parameter("You solve arithmetic.", role="system prompt")
    data = [("six times seven", "42"), ("two plus two", "4")]

    async def accuracy() -> float:
        losses, scores = [], []
        for question, target in data:
            answer = await llm_call(prompt, question, model=model, role="answer")
            score, loss = await deterministic_evaluator(exact, answer, target)
            losses.append(loss)
            scores.append(score.data)
        if any(loss.data for loss in losses):
            for loss in losses:
                await loss.backward()
        return sum(scores) / len(scores)

    tgd = TGD([prompt], model=model)
    assert await accuracy() == 0.0
    assert prompt.grad is not None
    await tgd.step()
    tgd.zero_grad()
    assert prompt.data == f"You solve arithmetic. {RULE}"
    assert await accuracy() == 1.0


# --- The same backwards on a worker, through a real Redis ------------------------------


async def _pipeline(executor: Any = None) -> dict[str, Any]:
    prompt = Parameter("Answer briefly.", role="system prompt")
    greeting = Parameter("Hello", role="greeting")
    name = Parameter("Ada", role="name")
    answer = await llm_call(prompt, "Who wrote the first program?", model=SPEC, role="answer")
    both = RemoteAdd.apply(greeting, ", ") + name  # a remote Add, then the local one
    joined = await python_call(
        join_words, answer, both, purpose="Puts the greeting after the answer.", feedback_model=SPEC
    )
    _, loss = await RemoteEvaluator.apply(exact, joined, "Ada Lovelace", role="grading")
    await loss.backward(executor=executor)
    grads = {p.role: p.grad.data if p.grad else None for p in (prompt, greeting, name)}
    json.dumps(grads)
    return grads


async def test_remote_backwards_equal_local_ones(redis_url: str) -> None:
    local = await _pipeline()
    assert all(local.values()), local
    async with remote_executor(
        redis_url, "pyfunc-tests", ["asyncgraph.text", "text_helpers"]
    ) as executor:
        remote = await _pipeline(executor)
        # evaluator, PythonCall, LLMCall and RemoteAdd ran on the worker; the local Add did not
        assert executor.stats.submitted == 4
    assert remote == local


async def test_a_remote_python_call_needs_a_portable_feedback_model() -> None:
    a = Parameter("x", role="word")
    model = SimulatedModel(latency_s=0)
    out = await python_call(shout, a, purpose="Upper-cases.", feedback_model=model)
    with pytest.raises(ValueError, match="only this process knows"):
        check_portable(out)
