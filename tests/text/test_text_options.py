"""Typed text options: one frozen record per call, on ``ctx.options``, read by backward."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import FrozenInstanceError
from typing import Any, ClassVar

import msgpack
import pytest
from text_helpers import Recorder

from asyncgraph import FunctionCtx, Parameter, Variable
from asyncgraph.models import OpenAIChat
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.text import (
    FormattedLLMCall,
    LLMCall,
    LLMOptions,
    PythonCall,
    TextLoss,
    chat_call,
    formatted_llm_call,
    llm_call,
    python_call,
    register_model,
    render_feedback,
    use_feedback_budget,
    use_models,
)
from asyncgraph.text._functions import ChatCall
from asyncgraph.text._options import CallKeywords, LLMKeywords, PythonCallOptions
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


# --- Every option reaches the model call, through every way to call one ----------------


@dataclasses.dataclass
class Grade:
    grade: int


def _call_every_way() -> dict[str, Callable[[Parameter, Variable, dict[str, Any]], Any]]:
    """Each public way to make an LLM call, given a system prompt, a question and options."""
    system_user = [{"role": "system"}, {"role": "user"}]
    return {
        "llm_call": lambda s, q, o: llm_call(s, q, **o),
        "formatted_llm_call": lambda s, q, o: formatted_llm_call(
            "Q: {question}", {"question": q}, system_prompt=s, **o
        ),
        "chat_call": lambda s, q, o: chat_call(
            [{**m, "content": c} for m, c in zip(system_user, (s, q), strict=True)], **o
        ),
        "TextLoss": lambda s, q, o: TextLoss(s, **o)(q),
        "LLMCall.apply": lambda s, q, o: LLMCall.apply(s, q, **o),
        "FormattedLLMCall.apply": lambda s, q, o: FormattedLLMCall.apply(
            "Q: {question}", s, **o, question=q
        ),
        "ChatCall.apply": lambda s, q, o: ChatCall.apply(("system", "user"), s, q, **o),
    }


@pytest.mark.parametrize("way", list(_call_every_way()))
async def test_every_option_reaches_the_model_call_of_every_wrapper(
    way: str, registered: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One valid value per field of ``LLMOptions`` (and ``base_url``), all given at once to
    each way of calling a model; each is then seen where it acts: in the requests a real
    local HTTP server received (forward: one server, backward: another), in the reply's
    parsing and role, and in the gradient. A field added to the record fails here until
    it has a value and a check, and until every wrapper passes it on."""
    monkeypatch.setenv("OPENAI_API_KEY", "test")
    with OpenAITestServer() as main, OpenAITestServer() as critic:
        registered.append(
            register_model(
                f"tests-critic-{critic.port}",
                OpenAIChat("critic-model", base_url=critic.url, api_key="test"),
            )
        )
        bad, good = Reply(text="no json here"), Reply(text=json.dumps({"grade": 7}))
        main.script(bad, bad, bad, good)  # the 4th attempt parses: format_attempts=4, not 3
        values: dict[str, Any] = {
            "model": "openai:forward-model",
            "base_url": main.url,
            "params": {"temperature": 0.25},
            "feedback_model": f"tests-critic-{critic.port}",
            "feedback_params": {"temperature": 0.75},
            "role": "graded answer",
            "feedback_budget": 8,
            "response_format": Grade,
            "format_attempts": 4,
        }
        fields = {f.name for f in dataclasses.fields(LLMOptions)}
        assert set(values) == fields | {"base_url"} == LLMOptions.KEYWORDS

        system = Parameter("Grade the answer.", role="grading prompt")
        question = Variable("What is 6 * 7? 42.", role="question and answer")
        out = await _call_every_way()[way](system, question, values)
        forward = [r.body for r in main.requests]
        await out.backward(Variable("the grade is too generous " * 40, role="review"))
        backward = [r.body for r in critic.requests]

    checks = {
        "model": all(body["model"] == "forward-model" for body in forward),
        "base_url": len(forward) == 4 and len(main.requests) == 4,  # nothing else went there
        "params": all(body["temperature"] == 0.25 for body in forward),
        "feedback_model": len(backward) >= 2  # a summary of the feedback, then the request
        and all(body["model"] == "critic-model" for body in backward),
        "feedback_params": all(body["temperature"] == 0.75 for body in backward),
        "role": out.role == "graded answer"
        and "graded answer" in backward[-1]["messages"][-1]["content"],
        "feedback_budget": "feedback budget of 8 tokens" in render_feedback(system.grad),
        "response_format": out.data == {"grade": 7}
        and all(body["response_format"]["json_schema"]["name"] == "Grade" for body in forward),
        "format_attempts": len(forward) == 4,
    }
    assert set(checks) == set(values)
    assert [name for name, ok in checks.items() if not ok] == []


async def test_the_wrappers_keyword_signature_is_the_records_fields() -> None:
    """``LLMKeywords`` (what the type checker reads) names exactly ``LLMOptions.KEYWORDS``;
    ``TextLoss`` takes the same, ``model`` as its second parameter."""
    fields = {f.name for f in dataclasses.fields(LLMOptions)}
    assert set(LLMKeywords.__annotations__) == fields | {"base_url"} == LLMOptions.KEYWORDS
    assert set(CallKeywords.__annotations__) == LLMOptions.KEYWORDS - {"model"}
    assert LLMKeywords.__required_keys__ == frozenset()
    for function in (LLMCall, FormattedLLMCall, ChatCall):
        assert function.option_keywords == LLMOptions.KEYWORDS
    for wrapper in (llm_call, formatted_llm_call, chat_call):
        params = inspect.signature(wrapper).parameters
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
        assert not LLMOptions.KEYWORDS & set(params), wrapper.__name__
    with pytest.raises(TypeError, match=r"llm_call got unexpected .*\['feedbak_budget'\]"):
        await llm_call("s", "q", model="simulated:0", feedbak_budget=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"formatted_llm_call got unexpected .*\['modle'\]"):
        await formatted_llm_call("{q}", {"q": "x"}, modle="simulated:0")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"TextLoss got unexpected .*\['temperature'\]"):
        TextLoss("Judge.", "simulated:0", temperature=0)  # type: ignore[call-arg]


# --- Options are not inputs of the node --------------------------------------------------


def _spy(base: Any) -> Any:
    """``base`` with a backward that records the ``ctx.needs_input_grad`` it saw."""

    class Spy(base):  # type: ignore[misc, valid-type]
        seen: ClassVar[list[tuple[bool, ...]]] = []

        @staticmethod
        async def backward(ctx: Any, grad: Variable | None) -> tuple[Variable | None, ...]:
            Spy.seen.append(tuple(ctx.needs_input_grad))
            return tuple(await base.backward(ctx, grad))

    return Spy


@pytest.mark.parametrize("base", [LLMCall, FormattedLLMCall, ChatCall])
async def test_the_options_are_not_inputs_of_the_node(
    base: Any, recorder: Recorder, registered: list[str]
) -> None:
    """One entry in ``needs_input_grad`` (in forward's ctx and in backward's) and one edge
    per argument that is an input, whatever options are given: ``llm_call(prompt, question,
    model=..., params=..., ...)`` has two, not one per option too."""
    registered.append(register_model("tests-options-inputs", recorder.model))
    spy = _spy(base)
    prompt = Parameter("Answer.", role="system prompt")
    question = Variable("6 * 7?", role="question")
    options: dict[str, Any] = {
        "model": "tests-options-inputs",
        "params": {"seed": 1},
        "feedback_model": "tests-options-inputs",
        "feedback_params": {"seed": 2},
        "role": "answer",
        "feedback_budget": None,
    }
    if base is LLMCall:
        out = await spy.apply(prompt, question, **options)
        expected = (True, False)  # the system prompt, the question
    elif base is FormattedLLMCall:
        out = await spy.apply("Q: {question}", prompt, **options, question=question)
        expected = (False, True, False)  # the template, the system prompt, the field
    else:
        out = await spy.apply(("system", "user"), prompt, question, **options)
        expected = (False, True, False)  # the roles, the two messages
    node = out.grad_fn
    assert node is not None and node.ctx.needs_input_grad == expected
    assert len(node.next_functions) == len(expected)
    assert [fn is not None for fn, _ in node.next_functions] == list(expected)
    await out.backward(Variable("too long"))
    assert spy.seen == [expected]
    assert prompt.grad is not None and question.grad is None


async def test_llm_call_records_one_input_per_argument(recorder: Recorder) -> None:
    prompt = Parameter("sys")
    answer = await llm_call(
        prompt, "q", model=recorder.model, params={"seed": 1}, role="answer", feedback_budget=9
    )
    assert answer.grad_fn is not None
    assert answer.grad_fn.ctx.needs_input_grad == (True, False)
    assert len(answer.grad_fn.next_functions) == 2


async def test_a_variable_given_as_an_option_is_refused_before_the_call(recorder: Recorder) -> None:
    with pytest.raises(TypeError, match=r"LLMCall: option role= must be plain data"):
        await LLMCall.apply("sys", "x", model=recorder.model, role=Parameter("r"))
    assert recorder.requests == []


async def test_python_call_options_are_its_records_fields_and_not_inputs(
    registered: list[str],
) -> None:
    recorder = Recorder()
    registered.append(register_model("tests-options-pyfunc", recorder.model))
    assert PythonCall.option_keywords == PythonCallOptions.KEYWORDS
    assert PythonCallOptions.KEYWORDS == {f.name for f in dataclasses.fields(PythonCallOptions)}
    text = Parameter("a b c", role="text")
    given = {
        "purpose": "Counts the words.",
        "role": "word count",
        "feedback_model": "tests-options-pyfunc",
        "feedback_params": {"seed": 3},
        "feedback_budget": 7,
    }
    assert set(given) == PythonCallOptions.KEYWORDS
    out = await python_call(lambda t, sep: len(t.split(sep)), text, sep=" ", **given)
    assert out.data == 3 and out.grad_fn is not None
    assert out.grad_fn.ctx.options == PythonCallOptions(
        purpose="Counts the words.",
        role="word count",
        feedback_model=ModelRef("tests-options-pyfunc"),
        feedback_params={"seed": 3},
        feedback_budget=7,
    )
    # fn, the text, the named input sep: no entry for an option.
    assert out.grad_fn.ctx.needs_input_grad == (False, True, False)
    await out.backward(Variable("count the words again " * 10))
    assert render_feedback(text.grad).startswith("[built from condensed feedback")
