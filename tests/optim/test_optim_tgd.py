from __future__ import annotations

import json
import re
from typing import Any

import anyio
import pytest
from optim_helpers import Script, improve

from asyncgraph import Parameter, Variable
from asyncgraph.models import MemoryCache, OpenAIChat, SimulatedModel
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.optim import TGD, NoFeedbackWarning, ReplySkippedWarning, UpdateParseError
from asyncgraph.optim._tgd import parse_tagged
from asyncgraph.text import TextLoss, approx_tokens, llm_call, render_feedback

pytestmark = pytest.mark.anyio


def _param(value: str, role: str, feedback: Any) -> Parameter:
    p = Parameter(value, role=role)
    p.grad = None if feedback is None else Variable(feedback)
    return p


def test_parse_tagged_takes_the_last_complete_span() -> None:
    reply = "Put it between <X> and </X>.\n<X>\n  new value \n</X> done"
    assert parse_tagged(reply, "<X>", "</X>") == "new value"
    assert parse_tagged("no tags", "<X>", "</X>") is None
    assert parse_tagged("<X>unclosed", "<X>", "</X>") is None
    assert parse_tagged("</X> closed before <X>", "<X>", "</X>") is None


def test_parse_tagged_skips_an_open_tag_quoted_before_the_answer() -> None:
    reply = "Put it between <IMPROVED_VARIABLE> tags.\n<IMPROVED_VARIABLE>new</IMPROVED_VARIABLE>"
    assert parse_tagged(reply, "<IMPROVED_VARIABLE>", "</IMPROVED_VARIABLE>") == "new"


def test_parse_tagged_matches_tags_case_insensitively() -> None:
    reply = "Here: <improved_variable> new value </Improved_Variable>"
    assert parse_tagged(reply, "<IMPROVED_VARIABLE>", "</IMPROVED_VARIABLE>") == "new value"
    assert parse_tagged("```\ncode\n```", "```", "```") == "code"  # one tag for both ends


async def test_step_rewrites_each_parameter_from_its_feedback() -> None:
    script = Script()
    p = _param("Answer.", "system prompt", ["too short", "no units"])
    tgd = TGD([p], model=script.model, constraints=["Keep it under 20 words."])
    await tgd.step()
    assert p.data == "Answer.+"
    (request,) = script.requests
    system, user = request[0]["content"], request[1]["content"]
    assert "<IMPROVED_VARIABLE>" in system
    assert "<ROLE>the system prompt</ROLE>" in user
    assert "<VARIABLE>Answer.</VARIABLE>" in user
    assert "--- feedback 1 of 2 ---\ntoo short" in user and "no units" in user
    assert "<CONSTRAINTS>\n- Keep it under 20 words.\n</CONSTRAINTS>" in user
    assert tgd.state[p] == {"step": 1}


async def test_builtin_simulated_model_round_trip_through_backward() -> None:
    model = SimulatedModel(latency_s=0.0)
    prompt = Parameter("Answer the question.", role="system prompt")
    answer = await llm_call(prompt, "What is 2 + 2?", model=model, role="answer")
    loss = await TextLoss("Evaluate the answer critically.", model=model)(answer)
    await loss.backward()
    tgd = TGD([prompt], model=model)
    await tgd.step()
    assert prompt.data.startswith("Answer the question.\n[simulated edit]")
    tgd.zero_grad()
    assert prompt.grad is None


async def test_parameters_without_feedback_are_left_alone() -> None:
    script = Script()
    none = _param("a", "first", None)
    empty = _param("b", "second", ["", ""])
    some = _param("c", "third", "fix it")
    with pytest.warns(NoFeedbackWarning) as warned:
        await TGD([none, empty, some], model=script.model).step()
    assert (none.data, empty.data, some.data) == ("a", "b", "c+")
    assert len(script.requests) == 1
    # The one that got no gradient at all is named; empty feedback is feedback.
    assert [str(w.message)[:60] for w in warned] == [
        "TGD.step(): parameter 0 ('first') received no feedback in th"
    ]


async def test_all_parameters_are_updated_concurrently() -> None:
    arrived = 0
    all_in = anyio.Event()

    async def responder(messages: list[dict[str, Any]]) -> str:
        nonlocal arrived
        arrived += 1
        if arrived == 3:
            all_in.set()
        await all_in.wait()  # a sequential step would wait here forever
        return improve(messages)

    script = Script(responder)
    params = [_param(f"v{i}", f"role {i}", "fb") for i in range(3)]
    with anyio.fail_after(60):
        await TGD(params, model=script.model).step()
    assert [p.data for p in params] == ["v0+", "v1+", "v2+"]


async def test_reply_without_tags_is_retried_with_a_correction() -> None:
    replies = iter(
        [
            "I think it is fine.",
            "<IMPROVED_VARIABLE></IMPROVED_VARIABLE>",
            "<IMPROVED_VARIABLE>new</IMPROVED_VARIABLE>",
        ]
    )
    script = Script(lambda messages: next(replies))
    p = _param("old", "system prompt", "fb")
    await TGD([p], model=script.model, max_retries=2).step()
    assert p.data == "new"
    assert len(script.requests) == 3
    second, third = script.requests[1], script.requests[2]
    assert second[-2] == {"role": "assistant", "content": "I think it is fine."}
    assert "did not contain the improved variable" in second[-1]["content"]
    assert "was empty" in third[-1]["content"]


async def test_replies_without_tags_end_in_a_clear_error_and_change_nothing() -> None:
    def responder(messages: list[dict[str, Any]]) -> str:
        if "<VARIABLE>keep</VARIABLE>" in messages[1]["content"]:
            return improve(messages)
        return "Sorry, I cannot help with that. " * 20

    script = Script(responder)
    good = _param("keep", "instructions", "fb")
    bad = _param("old", "system prompt", "fb")
    tgd = TGD([good, bad], model=script.model, max_retries=1, strict=True)
    with pytest.raises(UpdateParseError) as info:
        await tgd.step()
    error = info.value
    assert not isinstance(error, IndexError)
    assert error.role == "system prompt" and error.attempts == 2
    message = str(error)
    assert "'system prompt'" in message and "<IMPROVED_VARIABLE>...</IMPROVED_VARIABLE>" in message
    assert "Sorry, I cannot help with that." in message and "…" in message  # an excerpt
    assert error.reply == "Sorry, I cannot help with that. " * 20
    assert (good.data, bad.data) == ("keep", "old")  # no half-applied step
    assert tgd.state == {}


async def test_an_unreadable_update_is_skipped_the_others_applied_and_recorded() -> None:
    def responder(messages: list[dict[str, Any]]) -> str:
        if "<VARIABLE>keep</VARIABLE>" in messages[1]["content"]:
            return improve(messages)
        return "Sorry, I cannot help with that."

    script = Script(responder)
    good = _param("keep", "instructions", "fb")
    bad = _param("old", "system prompt", "fb")
    tgd = TGD([good, bad], model=script.model, max_retries=1)
    with pytest.warns(ReplySkippedWarning, match="'system prompt' was skipped"):
        await tgd.step()
    assert bad.data == "old" and good.data != "keep"  # the readable update is applied
    assert [(s.role, s.attempts, s.structured) for s in tgd.skipped] == [
        ("system prompt", 2, False)
    ]
    assert tgd.skipped[0].to_data()["reply"] == "Sorry, I cannot help with that."
    assert bad not in tgd.state and tgd.state[good]["step"] == 1  # no step counted for it
    tgd.warn_no_feedback = False
    good.grad = None
    with pytest.warns(ReplySkippedWarning):
        await tgd.step()  # the next step starts a new list
    assert len(tgd.skipped) == 1


async def test_retry_and_error_against_the_openai_protocol_server() -> None:
    with OpenAITestServer() as server:
        server.script(
            Reply(text="no tags"),
            Reply(text="<IMPROVED_VARIABLE>Answer with a number.</IMPROVED_VARIABLE>"),
            Reply(text="still no tags"),
            Reply(text="nope"),
        )
        async with OpenAIChat(
            "test-model", base_url=server.url, api_key="test", cache=MemoryCache()
        ) as model:
            p = _param("Answer.", "system prompt", "Give the number.")
            tgd = TGD([p], model=model, max_retries=1, strict=True)
            await tgd.step()
            assert p.data == "Answer with a number."
            assert len(server.requests) == 2  # the retry is a new request, not a cache hit
            retry_body = server.requests[1].body
            assert retry_body["messages"][-2] == {"role": "assistant", "content": "no tags"}

            p.grad = Variable("Shorter.")
            with pytest.raises(UpdateParseError, match="'nope'"):
                await tgd.step()
            assert p.data == "Answer with a number."


def _is_summary(messages: list[dict[str, Any]]) -> bool:
    return "condense" in messages[0]["content"]


def _request_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(approx_tokens(m["content"]) for m in messages)


# What a summary request holds besides its chunk of feedback: the fixed instruction and
# the role (a few dozen tokens here); the guard promises the chunk stays within budget.
SUMMARY_OVERHEAD_TOKENS = 150


async def test_feedback_over_budget_is_condensed_by_map_reduce() -> None:
    def responder(messages: list[dict[str, Any]]) -> str:
        if _is_summary(messages):
            return "SUMMARY: be specific; give units."
        return improve(messages)

    script = Script(responder)
    entries = [f"Sample {i}: the answer lacks units and is vague. " * 4 for i in range(100)]
    p = _param("Answer.", "system prompt", entries)
    tgd = TGD([p], model=script.model, max_feedback_tokens=500)
    await tgd.step()

    *summaries, update = script.requests
    assert all(_is_summary(r) for r in summaries) and not _is_summary(update)
    *chunks, final = [r[-1]["content"] for r in summaries]
    assert len(chunks) > 1
    # Round 1: every entry in exactly one chunk of consecutive entries, each within budget
    # (the chunks are sent concurrently, so they arrive in any order).
    per_chunk = sorted([int(m) for m in re.findall(r"Sample (\d+):", c)[::4]] for c in chunks)
    assert [n for numbers in per_chunk for n in numbers] == list(range(100))
    for chunk in chunks:
        feedback = chunk.split("<FEEDBACK>\n", 1)[1].rsplit("\n</FEEDBACK>", 1)[0]
        assert approx_tokens(feedback) <= 500
        assert "Below is feedback from" in chunk  # entries as the backward produced them
    # Round 2: the summaries of round 1, condensed into the budget by one request.
    assert f"{len(chunks)} summaries of feedback" in final and "(500 tokens)" in final
    assert final.count("SUMMARY: be specific; give units.") == len(chunks)
    assert "<FEEDBACK>\nSUMMARY: be specific; give units.\n</FEEDBACK>" in update[-1]["content"]
    assert "Sample 0:" not in update[-1]["content"]
    assert p.data == "Answer.+"


async def test_a_thousand_entries_never_overflow_any_request() -> None:
    budget = 4000
    sizes: list[tuple[bool, int]] = []

    def responder(messages: list[dict[str, Any]]) -> str:
        sizes.append((_is_summary(messages), _request_tokens(messages)))
        if _is_summary(messages):
            # A model that ignores the requested length: repeats most of its input.
            return messages[-1]["content"][:6000]
        return improve(messages)

    script = Script(responder)
    entries = [f"Sample {i}: " + "the answer lacks units and is vague; " * 40 for i in range(1000)]
    p = _param("Answer.", "system prompt", entries)
    assert approx_tokens(render_feedback(entries)) > 350_000  # ~90x the budget
    tgd = TGD([p], model=script.model, max_feedback_tokens=budget, momentum=1)
    await tgd.step()

    summary_sizes = [n for is_summary, n in sizes if is_summary]
    assert len(summary_sizes) > 100  # round 1 alone has ~100 chunks
    assert max(summary_sizes) <= budget + SUMMARY_OVERHEAD_TOKENS
    update_size = sizes[-1][1]
    assert not sizes[-1][0] and update_size <= budget + SUMMARY_OVERHEAD_TOKENS
    assert approx_tokens(tgd.state[p]["history"][0]["feedback"]) <= budget


async def test_chunks_of_one_round_are_summarised_concurrently() -> None:
    arrived = 0
    all_in = anyio.Event()

    async def responder(messages: list[dict[str, Any]]) -> str:
        nonlocal arrived
        if not _is_summary(messages):
            return improve(messages)
        if "summaries of feedback" in messages[-1]["content"]:
            return "final"
        arrived += 1
        if arrived == 3:
            all_in.set()
        await all_in.wait()  # a sequential map would wait here forever
        return "partial"

    script = Script(responder)
    p = _param("Answer.", "system prompt", ["a" * 390, "b" * 390, "c" * 390])
    with anyio.fail_after(60):
        await TGD([p], model=script.model, max_feedback_tokens=100).step()
    assert arrived == 3 and p.data == "Answer.+"


async def test_an_entry_longer_than_the_budget_is_split_not_dropped() -> None:
    def responder(messages: list[dict[str, Any]]) -> str:
        return "short summary" if _is_summary(messages) else improve(messages)

    script = Script(responder)
    entry = "BEGIN " + "middle words " * 300 + " END"  # ~1000 tokens
    p = _param("Answer.", "system prompt", [entry, "second entry"])
    await TGD([p], model=script.model, max_feedback_tokens=200).step()
    chunks = [r[-1]["content"] for r in script.requests if _is_summary(r)]
    assert any("BEGIN" in c for c in chunks) and any("END" in c for c in chunks)
    assert any("second entry" in c for c in chunks)
    assert max(_request_tokens(r) for r in script.requests) <= 200 + SUMMARY_OVERHEAD_TOKENS


async def test_summary_still_over_budget_is_cut_to_the_budget() -> None:
    def responder(messages: list[dict[str, Any]]) -> str:
        if "condense" in messages[0]["content"]:
            return "word " * 5000
        return improve(messages)

    script = Script(responder)
    p = _param("Answer.", "system prompt", ["x" * 4000, "y" * 4000])
    tgd = TGD([p], model=script.model, max_feedback_tokens=100, momentum=1)
    await tgd.step()
    kept = tgd.state[p]["history"][0]["feedback"]
    assert approx_tokens(kept) <= 100
    assert kept.endswith("[... feedback truncated to max_feedback_tokens]")
    assert f"<FEEDBACK>\n{kept}\n</FEEDBACK>" in script.contents()[-1]


async def test_feedback_within_budget_is_not_condensed() -> None:
    script = Script()
    p = _param("Answer.", "system prompt", "short feedback")
    await TGD([p], model=script.model, max_feedback_tokens=100).step()
    assert len(script.requests) == 1


async def test_momentum_shows_past_values_and_feedback() -> None:
    script = Script()
    p = _param("v0", "system prompt", "fb0")
    tgd = TGD([p], model=script.model, momentum=2)
    for i in range(3):
        p.grad = Variable(f"fb{i}")
        await tgd.step()
    assert p.data == "v0+++"
    assert tgd.state[p] == {
        "step": 3,
        "history": [{"value": "v0+", "feedback": "fb1"}, {"value": "v0++", "feedback": "fb2"}],
    }
    first, second, third = script.contents()
    assert "<PAST_ITERATIONS>" not in first
    assert '<ITERATION index="1">\n<PAST_VALUE>v0</PAST_VALUE>' in second
    assert "<PAST_VALUE>v0</PAST_VALUE>" in third and "<PAST_VALUE>v0+</PAST_VALUE>" in third
    assert third.count("<ITERATION") == 2


async def test_memory_in_the_update_prompt_is_cut_to_the_budget() -> None:
    script = Script()
    p = _param("current", "system prompt", "fb")
    tgd = TGD([p], model=script.model, momentum=1, max_feedback_tokens=100)
    long_past = {"value": "v" * 2000, "feedback": "f" * 2000}  # e.g. from an older checkpoint
    group = {"constraints": [], "momentum": 1, "max_feedback_tokens": 100, "params": [0]}
    tgd.load_state_dict(
        {"state": {"0": {"step": 1, "history": [long_past]}}, "param_groups": [group]}
    )
    await tgd.step()
    prompt = script.contents()[-1]
    past_value = re.search(r"<PAST_VALUE>(.*?)</PAST_VALUE>", prompt, re.DOTALL)
    past_feedback = re.search(r"<PAST_FEEDBACK>\n(.*?)\n</PAST_FEEDBACK>", prompt, re.DOTALL)
    assert past_value is not None and past_feedback is not None
    for shown in (past_value[1], past_feedback[1]):
        assert approx_tokens(shown) <= 100
        assert shown.endswith("[... truncated to max_feedback_tokens]")
    assert approx_tokens(prompt) <= 3 * 100 + 300  # (2 * momentum + 1) budgets + the prompt
    assert tgd.state[p]["history"][-1]["value"] == "current"  # the state itself is not cut


async def test_an_unparsable_reply_is_not_replayed_from_the_cache() -> None:
    with OpenAITestServer() as server:
        server.script(Reply(text="I would rather not."))  # then: the good reply below
        good = Reply(text="<IMPROVED_VARIABLE>Answer with units.</IMPROVED_VARIABLE>")
        server.handler = lambda body: good
        async with OpenAIChat(
            "test-model", base_url=server.url, api_key="test", cache=MemoryCache()
        ) as model:
            p = _param("Answer.", "system prompt", "Give units.")
            tgd = TGD([p], model=model, max_retries=0, strict=True)
            with pytest.raises(UpdateParseError, match="rather not"):
                await tgd.step()
            await tgd.step()  # the same request again: asks the server, not the cache
            assert p.data == "Answer with units."
            assert server.statuses() == [200, 200]
            assert model.usage.snapshot().cache_hits == 0


async def test_state_dict_is_json_and_restores_memory() -> None:
    script = Script()
    a = _param("a", "first", "fa")
    b = _param("b", "second", "fb")
    tgd = TGD(
        [{"params": [a], "constraints": ["Short."]}, {"params": [b]}],
        model=script.model,
        momentum=1,
    )
    await tgd.step()
    saved = tgd.state_dict()
    assert json.loads(json.dumps(saved)) == saved  # exact JSON round trip, for checkpoints
    assert saved["param_groups"] == [
        {"constraints": ["Short."], "momentum": 1, "max_feedback_tokens": 4000, "params": [0]},
        {"constraints": [], "momentum": 1, "max_feedback_tokens": 4000, "params": [1]},
    ]
    assert saved["state"] == {
        "0": {"step": 1, "history": [{"value": "a", "feedback": "fa"}]},
        "1": {"step": 1, "history": [{"value": "b", "feedback": "fb"}]},
    }

    fresh = TGD([{"params": [a]}, {"params": [b]}], model=script.model)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["constraints"] == ["Short."]
    assert fresh.state[a] == {"step": 1, "history": [{"value": "a", "feedback": "fa"}]}
    fresh.zero_grad()
    a.grad = Variable("again")
    with pytest.warns(NoFeedbackWarning, match=r"parameter 1 \('second'\)"):
        await fresh.step()
    last = script.contents()[-1]
    assert "<PAST_VALUE>a</PAST_VALUE>" in last and "- Short." in last
    assert fresh.state[a]["step"] == 2


async def test_text_optimizer_rejects_numeric_parameters() -> None:
    p = Parameter(1.5, role="weight")
    p.grad = Variable("make it bigger")
    with pytest.raises(TypeError, match="Use SGD"):
        await TGD([p], model=Script().model).step()


def test_bad_options_are_rejected() -> None:
    p = Parameter("x", role="r")
    model = Script().model
    with pytest.raises(ValueError, match="momentum"):
        TGD([p], model=model, momentum=-1)
    with pytest.raises(ValueError, match="max_feedback_tokens"):
        TGD([p], model=model, max_feedback_tokens=0)
    with pytest.raises(ValueError, match="max_retries"):
        TGD([p], model=model, max_retries=-1)
    with pytest.raises(ValueError, match="max_retries"):
        TGD([p], model=model, max_retries=True)
    with pytest.raises(ValueError, match="max_feedback_tokens"):
        TGD([p], model=model, max_feedback_tokens=True)
    with pytest.raises(TypeError, match="constraints"):
        TGD([p], model=model, constraints="Be short.")  # type: ignore[arg-type]
