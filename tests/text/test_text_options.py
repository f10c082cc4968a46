"""Typed text options: one frozen record per call, on ``ctx.options``, read by backward."""

from __future__ import annotations

import dataclasses
from dataclasses import FrozenInstanceError
from typing import Any

import msgpack
import pytest
from text_helpers import Recorder

from asyncgraph import FunctionCtx, Parameter, Variable
from asyncgraph.text import (
    FormattedLLMCall,
    LLMCall,
    LLMOptions,
    PythonCall,
    chat_call,
    formatted_llm_call,
    llm_call,
    python_call,
    register_model,
    use_feedback_budget,
    use_models,
)
from asyncgraph.text._functions import ChatCall
from asyncgraph.text._options import PythonCallOptions
from asyncgraph.text._registry import ModelRef

pytestmark = pytest.mark.anyio


def _copy_without(ctx: FunctionCtx, name: str) -> FunctionCtx:
    """A ctx like ``ctx`` (as a worker would rebuild it) lacking attribute ``name``."""
    copy = FunctionCtx()
    for key, value in vars(ctx).items():
        if key != name:
            setattr(copy, key, value)
    return copy


async def test_the_options_record_is_frozen_and_has_no_default_for_a_misspelt_name() -> None:
    answer = await llm_call(Parameter("sys"), "q", model="simulated:0", params={"seed": 1})
    assert answer.grad_fn is not None
    options = answer.grad_fn.ctx.options
    assert isinstance(options, LLMOptions)
    with pytest.raises(FrozenInstanceError):
        options.feedback_budget = 1  # type: ignore[misc]
    with pytest.raises(AttributeError, match="feedbak_budget"):
        _ = options.feedbak_budget  # type: ignore[attr-defined]
    # One attribute holds them: none of the options is a ctx attribute of its own.
    public = {k for k in vars(answer.grad_fn.ctx) if not k.startswith("_")}
    assert public == {"needs_input_grad", "options", "system_prompt", "user_prompt", "output"} | {
        "slots",
        "images",
    }


async def test_a_misspelt_option_names_the_valid_ones() -> None:
    with pytest.raises(TypeError) as info:
        await LLMCall.apply("sys", "q", model="simulated:0", feedbak_model="simulated:0")
    message = str(info.value)
    assert "LLMCall got unexpected keyword argument(s) ['feedbak_model']" in message
    assert "its options are" in message and "'feedback_model'" in message
    with pytest.raises(TypeError, match=r"ChatCall got unexpected .*\['modle'\].*'model'"):
        await ChatCall.apply(("user",), "q", modle="simulated:0")
    with pytest.raises(TypeError, match=r"'role'"):
        LLMOptions.from_kwargs("my_call", {"model": "simulated:0", "rol": "x"})


async def test_one_record_holds_the_resolved_options_of_every_llm_call() -> None:
    """The wrappers only pass what they were given; the defaults come from one place."""

    @dataclasses.dataclass
    class Reply:
        text: str

    with use_models("simulated:0", feedback_params={"temperature": 0}), use_feedback_budget(9):
        a = await llm_call(Parameter("sys"), "q", role="answer")
        b = await formatted_llm_call("Q: {q}", {"q": Parameter("q")}, role="answer")
        c = await chat_call([{"role": "user", "content": Parameter("q")}], role="answer")
        structured = LLMOptions.from_kwargs(
            "LLMCall", {"format_attempts": 2, "response_format": Reply}
        )
    expected = LLMOptions(
        model=ModelRef("simulated:0"),
        feedback_params={"temperature": 0},
        role="answer",
        feedback_budget=9,
    )
    for out in (a, b, c):
        assert out.grad_fn is not None and out.grad_fn.ctx.options == expected
    assert structured.feedback_budget == 9 and structured.format_attempts == 2
    assert structured.format_attempts == 2 and structured.role == "response from the language model"
    assert structured.response_format["title"] == "Reply"  # the dataclass, as its schema


def test_the_constructor_checks_every_field() -> None:
    ref = ModelRef("simulated:0")
    with pytest.raises(TypeError, match="my_call: role must be a str, got 3"):
        LLMOptions(model=ref, role=3, where="my_call")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="format_attempts must be an int >= 1, got 0"):
        LLMOptions(model=ref, format_attempts=0)
    with pytest.raises(TypeError, match="a feedback budget is an int >= 1"):
        LLMOptions(model=ref, feedback_budget=0)
    with pytest.raises(TypeError, match="params must be a dict of model parameters"):
        LLMOptions(model=ref, params=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a ModelRef"):
        LLMOptions(model="simulated:0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs purpose="):
        PythonCallOptions(purpose=" ", role="r")
    # feedback_params not given: the backward uses a copy of the params.
    options = LLMOptions(model=ref, params={"seed": 1})
    assert options.feedback_params == {"seed": 1} and options.request_params == {"seed": 1}


async def test_the_backward_reads_the_options_from_ctx_options_only(registered: list[str]) -> None:
    recorder = Recorder()
    registered.append(register_model("tests-options-model", recorder.model))
    prompt = Parameter("sys", role="system prompt")
    out = await LLMCall.apply(prompt, "q", model="tests-options-model")
    assert out.grad_fn is not None
    ctx = out.grad_fn.ctx
    # No silent default: without the record the backward fails and names it.
    with pytest.raises(AttributeError, match=r"LLMCall: ctx.options is missing"):
        await LLMCall.backward(_copy_without(ctx, "options"), Variable("too vague"))
    # Nor does it read an option from anywhere else.
    stray = _copy_without(ctx, "options")
    stray.options = ctx.options.to_data()
    with pytest.raises(TypeError, match=r"ctx\.options must be a LLMOptions, got dict"):
        await LLMCall.backward(stray, Variable("too vague"))
    # Every other ctx attribute the backward reads is required too (no getattr default).
    with pytest.raises(AttributeError, match="images"):
        await LLMCall.backward(_copy_without(ctx, "images"), Variable("too vague"))

    grad = (await LLMCall.backward(ctx, Variable("too vague")))[0]
    assert (
        grad is not None
        and grad.data == "fix the system prompt for the response from the language model"
    )


async def test_python_call_keeps_its_options_in_one_record(registered: list[str]) -> None:
    recorder = Recorder()
    registered.append(register_model("tests-options-feedback", recorder.model))
    text = Parameter("a b c", role="text")
    out = await python_call(
        lambda t: len(t.split()),
        text,
        purpose="Counts the words.",
        feedback_model="tests-options-feedback",
        feedback_params={"temperature": 0},
    )
    assert out.grad_fn is not None
    options = out.grad_fn.ctx.options
    assert options == PythonCallOptions(
        purpose="Counts the words.",
        role="output of <lambda>",
        feedback_model=ModelRef("tests-options-feedback"),
        feedback_params={"temperature": 0},
    )
    with pytest.raises(AttributeError, match=r"PythonCall: ctx.options is missing"):
        await PythonCall.backward(_copy_without(out.grad_fn.ctx, "options"), Variable("more"))
    with pytest.raises(TypeError, match=r"got unexpected option\(s\) \['purpose '\]"):
        PythonCallOptions.from_kwargs(
            "PythonCall of f()", {"purpose ": "x"}, default_role="r", needs_feedback=False
        )


@pytest.mark.parametrize("function", [LLMCall, FormattedLLMCall, ChatCall, PythonCall])
def test_the_text_functions_declare_their_options_record(function: Any) -> None:
    expected = PythonCallOptions if function is PythonCall else LLMOptions
    assert dict(function.ctx_types) == {"options": expected}


def test_the_options_survive_a_msgpack_round_trip_and_nothing_else_does() -> None:
    options = LLMOptions(
        model=ModelRef("openai:gpt-test", "http://127.0.0.1:9/v1"),
        params={"temperature": 0.5},
        feedback_model=ModelRef("simulated:0"),
        role="answer",
        feedback_budget=None,
        response_format={"type": "object", "properties": {"a": {"type": "integer"}}},
    )
    data = msgpack.unpackb(msgpack.packb(options.to_data()), raw=False)
    assert LLMOptions.from_data(data) == options
    py = PythonCallOptions(purpose="p", role="r", feedback_model=None)
    assert PythonCallOptions.from_data(msgpack.unpackb(msgpack.packb(py.to_data()))) == py
    # A field missing or unknown, or a value of the wrong type, is refused, not defaulted.
    for broken, match in (
        (
            {k: v for k, v in data.items() if k != "feedback_budget"},
            r"missing: \['feedback_budget'\]",
        ),
        ({**data, "extra": 1}, r"unknown: \[\"'extra'\"\]"),
        ({**data, "format_attempts": "3"}, "format_attempts must be an int"),
        ({**data, "model": "openai:gpt-test"}, "malformed model reference"),
        ([], "must be a map"),
    ):
        with pytest.raises(TypeError, match=match):
            LLMOptions.from_data(broken)
