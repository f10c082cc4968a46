from __future__ import annotations

import gc
from typing import Any

import anyio
import msgpack
import pytest
from text_helpers import Recorder

from asyncgraph import BackwardError, FunctionCtx, Parameter, Variable, backward
from asyncgraph.models import ModelRequestError, SimulatedModel
from asyncgraph.text import (
    FormattedLLMCall,
    LLMCall,
    Metric,
    TextLoss,
    check_portable,
    concat,
    exact_match,
    formatted_llm_call,
    llm_call,
    register_model,
    render_feedback,
)
from asyncgraph.text._functions import Concat, ExactMatch
from asyncgraph.text._pyfunc import REMOTE_FUNCTIONS

pytestmark = pytest.mark.anyio


async def test_llm_call_sends_system_prompt_and_inputs(recorder: Recorder) -> None:
    prompt = Parameter("Answer briefly.", role="system prompt")
    question = Variable("What is 2 + 2?", role="question")
    answer = await llm_call(prompt, question, "Show your work.", model=recorder.model)
    assert recorder.requests == [
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 2?\n\nShow your work."},
        ]
    ]
    assert answer.data == "out(What is 2 + 2?\n\nShow your work.)"
    assert answer.role == "response from the language model"
    assert answer.grad_fn is not None and answer.grad_fn.name == "LLMCall"


async def test_llm_call_without_system_prompt_and_with_params(recorder: Recorder) -> None:
    answer = await LLMCall.apply(
        None, "hi", model=recorder.model, params={"temperature": 0}, role="greeting"
    )
    assert recorder.requests[0] == [{"role": "user", "content": "hi"}]
    assert answer.role == "greeting"
    assert not answer.requires_grad  # no input requires grad: nothing recorded


async def test_backward_asks_feedback_for_each_input_needing_it_naming_roles(
    recorder: Recorder,
) -> None:
    prompt = Parameter("Answer briefly.", role="system prompt")
    question = Variable("What is 2 + 2?", role="question")  # constant: no feedback asked
    context = Parameter("Arithmetic facts.", role="context")
    answer = await llm_call(prompt, question, context, model=recorder.model, role="answer")
    await backward(answer, "The answer has no number in it.")
    assert prompt.grad is not None and context.grad is not None and question.grad is None
    assert prompt.grad.data == "fix the system prompt for the answer"
    assert context.grad.data == "fix the context for the answer"
    requests = recorder.feedback_requests()
    assert len(requests) == 2
    for text in requests:
        assert "<LM_SYSTEM_PROMPT>\nAnswer briefly.\n</LM_SYSTEM_PROMPT>" in text
        assert "<OUTPUT_FEEDBACK>\nThe answer has no number in it.\n</OUTPUT_FEEDBACK>" in text
    assert "<VARIABLE>Arithmetic facts.</VARIABLE>" in "".join(requests)


async def test_all_inputs_feedback_requests_are_sent_concurrently() -> None:
    arrived = 0
    both_in = anyio.Event()

    async def responder(messages: list[dict[str, Any]]) -> str:
        nonlocal arrived
        if "<VARIABLE>" in messages[-1]["content"]:
            arrived += 1
            if arrived == 2:
                both_in.set()
            await both_in.wait()  # a sequential backward would wait here forever
        return "ok"

    model = SimulatedModel(latency_s=0.0, responder=responder, tag_replies=False)
    a, b = Parameter("a", role="first"), Parameter("b", role="second")
    out = await llm_call(a, b, model=model)
    with anyio.fail_after(60):
        await out.backward("better")
    assert a.grad is not None and b.grad is not None


async def test_empty_output_feedback_makes_the_output_the_objective(recorder: Recorder) -> None:
    prompt = Parameter("Judge it.", role="system prompt")
    verdict = await llm_call(prompt, "an answer", model=recorder.model, role="evaluation")
    await verdict.backward()  # implicit gradient of a string: ""
    (request,) = recorder.feedback_requests()
    assert "No feedback was given on the output" in request
    assert "<OUTPUT_FEEDBACK>" not in request


async def test_list_feedback_on_the_output_is_rendered_in_order(recorder: Recorder) -> None:
    prompt = Parameter("p", role="system prompt")
    out = await llm_call(prompt, "x", model=recorder.model)
    await backward(out, Variable(["one", "two"]))
    (request,) = recorder.feedback_requests()
    assert "--- feedback 1 of 2 ---\none\n\n--- feedback 2 of 2 ---\ntwo" in request


async def test_formatted_call_fills_template_and_gives_fields_feedback(recorder: Recorder) -> None:
    instructions = Parameter("Be exact.", role="instructions")
    question = Variable("2 + 2?", role="question")
    notes = Parameter("Use base 10.", role="")
    out = await formatted_llm_call(
        "Q: {question}\nNotes: {notes}",
        {"question": question, "notes": notes},
        system_prompt=instructions,
        model=recorder.model,
        role="answer",
    )
    assert recorder.requests[0][1]["content"] == "Q: 2 + 2?\nNotes: Use base 10."
    await out.backward("wrong base")
    assert (
        instructions.grad is not None
        and instructions.grad.data == "fix the instructions for the answer"
    )
    # A field without a role is named by its field name.
    assert (
        notes.grad is not None
        and notes.grad.data == "fix the 'notes' field of the prompt for the answer"
    )


async def test_formatted_call_with_system_prompt_by_keyword_maps_gradients(
    recorder: Recorder,
) -> None:
    system = Parameter("sys", role="system prompt")
    field = Parameter("v", role="value")
    out = await FormattedLLMCall.apply("{x}", model=recorder.model, x=field, system_prompt=system)
    await out.backward("fb")
    assert system.grad is not None and system.grad.data.startswith("fix the system prompt")
    assert field.grad is not None and field.grad.data.startswith("fix the value")


async def test_formatted_call_rejects_field_mismatch(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match=r"missing: \['b'\], unused: \['c'\]"):
        await FormattedLLMCall.apply("{a} {b}", model=recorder.model, a="1", c="3")
    with pytest.raises(ValueError, match="plain name"):
        await FormattedLLMCall.apply("{0}", model=recorder.model)
    assert recorder.requests == []


async def test_llm_call_option_errors_are_clear(recorder: Recorder) -> None:
    with pytest.raises(TypeError, match="needs a model and none is set: pass model="):
        await LLMCall.apply("sys", "x")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['temperature'\]"):
        await LLMCall.apply("sys", "x", model=recorder.model, temperature=0)
    with pytest.raises(TypeError, match="must be plain data"):
        await LLMCall.apply("sys", "x", model=recorder.model, role=Variable("r"))


async def test_model_errors_in_backward_name_the_node() -> None:
    calls = 0

    def responder(messages: list[dict[str, Any]]) -> str:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ModelRequestError("bad request", status_code=400)
        return "fine"

    model = SimulatedModel(latency_s=0.0, responder=responder, tag_replies=False)
    prompt = Parameter("p", role="system prompt")
    x = Parameter("x", role="draft")
    out = await llm_call(prompt, x, model=model, role="answer")
    with pytest.raises(BackwardError, match="LLMCall") as info:
        await out.backward("fb")
    assert isinstance(info.value.__cause__, ModelRequestError)  # not an ExceptionGroup
    assert prompt.grad is None and x.grad is None


def test_concat_joins_and_names_its_output() -> None:
    a = Parameter("alpha", role="first answer")
    out = concat(a, "beta", Variable("gamma", role="third"), separator=" | ")
    assert out.data == "alpha | beta | gamma"
    assert out.role == "concatenation of first answer, third"
    assert Concat.dispatch == "local" and LLMCall.dispatch == "remote"


async def test_concat_hands_feedback_on_unchanged_once_per_variable() -> None:
    a = Parameter("a", role="a")
    b = Parameter("b", role="b")
    out = concat(a, b, a)
    await backward(out, Variable(["too long", "unclear"]))
    assert a.grad is not None and a.grad.data == ["too long", "unclear"]  # once, not twice
    assert b.grad is not None and b.grad.data == ["too long", "unclear"]
    assert a.grad.data is not b.grad.data


async def test_concat_backward_makes_no_model_call(recorder: Recorder) -> None:
    prompt = Parameter("p", role="system prompt")
    losses = [
        await llm_call(prompt, f"q{i}", model=recorder.model, role=f"loss {i}") for i in range(3)
    ]
    before = len(recorder.requests)
    total = concat(*losses)
    await total.backward()
    # one feedback request per loss, none for the concatenation itself
    assert len(recorder.requests) - before == 3
    assert prompt.grad is not None
    assert prompt.grad.data == [f"fix the system prompt for the loss {i}" for i in range(3)]


def test_exact_match_is_a_non_differentiable_metric() -> None:
    prediction = Parameter(" 42 ", role="answer")
    score = exact_match(prediction, "42")
    assert score.data == 1.0 and score.role == "exact match of answer"
    assert not score.requires_grad and score.grad_fn is None
    assert ExactMatch.apply("Yes", "yes").data == 0.0
    assert ExactMatch.apply("Yes", "yes", ignore_case=True).data == 1.0


async def test_metric_runs_sync_and_async_user_functions() -> None:
    answer = Parameter("the answer is 42", role="answer")
    score = await Metric.apply(
        lambda text, target: float(target in text), answer, "42", role="contains"
    )
    assert score.data == 1.0 and score.role == "contains" and not score.requires_grad

    async def length(text: str) -> int:
        return len(text)

    assert (await Metric.apply(length, answer)).data == len("the answer is 42")


async def test_backward_runs_from_a_msgpack_copy_of_the_ctx(registered: list[str]) -> None:
    """What a worker does: rebuild ctx from msgpack data (the options record through
    ``ctx_types``: ``to_data`` here, ``from_data`` there), resolve the model by name."""
    recorder = Recorder()
    registered.append(register_model("tests-text-worker-model", recorder.model))
    prompt = Parameter("Answer briefly.", role="system prompt")
    field = Parameter("draft", role="draft")
    out = await FormattedLLMCall.apply(
        "Improve: {draft}", prompt, model="tests-text-worker-model", draft=field, role="answer"
    )
    node = out.grad_fn
    assert node is not None and node.function in REMOTE_FUNCTIONS
    typed = node.function.ctx_types
    assert set(typed) == {"options"}
    public = {
        k: v.to_data() if k in typed else v
        for k, v in vars(node.ctx).items()
        if not k.startswith("_")
    }
    wire = msgpack.unpackb(msgpack.packb(public), raw=False)  # fails on non-plain data
    ctx = FunctionCtx()
    for key, value in wire.items():
        setattr(ctx, key, typed[key].from_data(value) if key in typed else value)
    assert ctx.options == node.ctx.options
    remote = await FormattedLLMCall.backward(ctx, Variable("too vague"))
    local = await FormattedLLMCall.backward(node.ctx, Variable("too vague"))
    assert [g.data if g is not None else None for g in remote] == [
        g.data if g is not None else None for g in local
    ]
    assert remote[1] is not None and remote[1].data == "fix the system prompt for the answer"


def test_subclasses_get_their_own_remote_name() -> None:
    class LocalLLMCall(LLMCall):
        dispatch = "local"

    assert LLMCall.remote_name == "asyncgraph.text.LLMCall"
    assert LocalLLMCall.remote_name is not None
    assert LocalLLMCall.remote_name.endswith(
        ":test_subclasses_get_their_own_remote_name.<locals>.LocalLLMCall"
    )
    assert LocalLLMCall.dispatch == "local"


async def test_model_objects_passed_inline_live_as_long_as_the_graph() -> None:
    # The registry holds model objects weakly: the graph's nodes keep them alive.
    prompt = Parameter("Answer the question.", role="system prompt")
    answer = await llm_call(prompt, "What is 2 + 2?", model=SimulatedModel(latency_s=0.0))
    loss = await TextLoss("Evaluate the answer.", model=SimulatedModel(latency_s=0.0))(answer)
    gc.collect()
    await loss.backward()
    assert prompt.grad is not None and "[simulated]" in render_feedback(prompt.grad)


async def test_check_portable_names_remote_nodes_that_use_model_objects() -> None:
    prompt = Parameter("Answer the question.", role="system prompt")
    judge = SimulatedModel(latency_s=0.0)
    answer = await llm_call(prompt, "What is 2 + 2?", model="simulated:0", role="answer")
    check_portable(answer)  # a spec: any worker resolves it
    loss = await TextLoss("Evaluate the answer.", model=judge, role="verdict")(answer)
    with pytest.raises(ValueError) as info:
        check_portable(loss)
    message = str(info.value)
    assert message.startswith("1 remote text node(s)")
    assert "LLMCall(inputs: 'evaluation instruction', 'answer'" in message
    assert "-> outputs: 'verdict'): model='instance:SimulatedModel:" in message
    assert "spec string such as 'openai:gpt-4o-mini'" in message and "--import" in message
    feedback_by_object = await llm_call(
        prompt, "q", model="simulated:0", feedback_model=judge, role="other"
    )
    with pytest.raises(ValueError, match="feedback_model='instance:SimulatedModel:"):
        check_portable(feedback_by_object)
    check_portable(concat(answer, "x"))  # Concat is local; its input names a spec
