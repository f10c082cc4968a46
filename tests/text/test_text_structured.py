"""Structured outputs: response_format= a JSON schema, a dataclass or a TypedDict (#13.4)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

import pytest
from text_helpers import Recorder

from asyncgraph import Parameter, Variable
from asyncgraph.models import OpenAIChat
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.text import (
    LLMCall,
    StructuredOutputError,
    TextLoss,
    json_schema_of,
    llm_call,
    render_feedback,
)
from asyncgraph.text._structured import schema_errors

pytestmark = pytest.mark.anyio

PLAN = {
    "title": "Plan",
    "type": "object",
    "properties": {
        "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "risk": {"enum": ["low", "high"]},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["name", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["steps", "risk", "owner"],
    "additionalProperties": False,
}
GOOD = {"steps": ["back up", "copy"], "risk": "low", "owner": {"name": "Ana", "days": 3}}


def scripted(*replies: str) -> Recorder:
    queue = list(replies)

    def respond(messages: list[dict[str, Any]]) -> str:
        if "<VARIABLE>" in messages[-1]["content"]:
            return "say who owns each step"
        return queue.pop(0) if queue else "no more replies"

    return Recorder(respond)


async def test_a_schema_violating_reply_is_retried_with_the_error_then_parsed() -> None:
    bad = {**GOOD, "owner": {"name": "Ana", "days": "three"}}
    rec = scripted(json.dumps(bad), "```json\n" + json.dumps(GOOD) + "\n```")
    prompt = Parameter("Plan the migration.", role="planner prompt")
    plan = await llm_call(prompt, "move the db", model=rec.model, response_format=PLAN)
    assert plan.data == GOOD  # parsed into dict data (a fenced reply is read inside)
    assert len(rec.requests) == 2
    retry = rec.requests[1]
    assert retry[-2] == {"role": "assistant", "content": json.dumps(bad)}
    assert '$.owner.days: expected integer, got "three"' in retry[-1]["content"]
    # Feedback still flows as text, through the same node.
    await plan.backward("the owner is missing for step 2")
    assert render_feedback(prompt.grad) == "say who owns each step"


async def test_a_reply_that_never_validates_raises_naming_the_schema_path() -> None:
    wrong = {**GOOD, "steps": [1]}
    rec = scripted(json.dumps(wrong), json.dumps(wrong), "not json at all")
    with pytest.raises(StructuredOutputError) as info:
        await LLMCall.apply("Plan.", "x", model=rec.model, response_format=PLAN)
    err = info.value
    assert err.path == "$" and err.attempts == 3 and err.reply == "not json at all"
    assert "not valid JSON" in str(err) and "'Plan'" in str(err)
    rec2 = scripted(json.dumps(wrong))
    with pytest.raises(StructuredOutputError, match=r"at \$\.steps\[0\]: expected string") as info:
        await LLMCall.apply("Plan.", "x", model=rec2.model, response_format=PLAN, format_attempts=1)
    assert info.value.path == "$.steps[0]"


@dataclass
class Verdict:
    score: int
    label: Literal["pass", "fail"]
    reasons: list[str] = field(default_factory=list)


class Review(TypedDict):
    summary: str
    severity: float
    tags: NotRequired[list[str]]


def test_dataclasses_and_typeddicts_become_json_schemas() -> None:
    assert json_schema_of(Verdict) == {
        "title": "Verdict",
        "type": "object",
        "properties": {
            "score": {"type": "integer"},
            "label": {"enum": ["pass", "fail"]},
            "reasons": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["score", "label"],
        "additionalProperties": False,
    }
    schema = json_schema_of(Review)
    assert schema["required"] == ["summary", "severity"]
    assert schema["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    with pytest.raises(TypeError, match="JSON schema"):
        json_schema_of(int)


def test_the_validator_reports_every_error_with_its_path() -> None:
    assert schema_errors(GOOD, PLAN) == []
    errors = schema_errors(
        {"steps": [], "risk": "mid", "owner": {"name": 1, "days": 2, "x": 0}, "extra": 1}, PLAN
    )
    assert errors == [  # in the order of the reply's own keys
        "$.steps: fewer than 1 items",
        "$.risk: expected one of ['low', 'high'], got \"mid\"",
        "$.owner.name: expected string, got 1",
        "$.owner: unexpected property 'x'",
        "$: unexpected property 'extra'",
    ]
    assert schema_errors(True, {"type": "integer"}) == ["$: expected integer, got true"]
    assert schema_errors(2, {"anyOf": [{"type": "string"}, {"type": "null"}]}) == [
        "$: matches none of the 2 allowed forms"
    ]


async def test_a_dataclass_response_format_in_a_loss() -> None:
    rec = scripted(json.dumps({"score": 7, "label": "pass"}))
    answer = Variable("42", role="answer", requires_grad=True)
    verdict = await LLMCall.apply("Grade it.", answer, model=rec.model, response_format=Verdict)
    assert verdict.data == {"score": 7, "label": "pass"}
    loss = TextLoss("Judge.", model=scripted("fine").model)
    assert (await loss(answer)).data == "fine"


async def test_the_schema_is_sent_as_an_openai_response_format() -> None:
    with OpenAITestServer() as server:
        server.script(Reply(text=json.dumps(GOOD)))
        model = OpenAIChat("test-model", base_url=server.url, api_key="test")
        plan = await llm_call("Plan.", "x", model=model, response_format=PLAN)
        assert plan.data == GOOD
        body = server.requests[0].body
        assert body["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "Plan", "schema": PLAN},
        }


async def test_bad_format_options_are_clear_errors() -> None:
    rec = scripted()
    with pytest.raises(TypeError, match="response_format must be a JSON schema"):
        await LLMCall.apply("s", "x", model=rec.model, response_format="json")
    with pytest.raises(TypeError, match="format_attempts must be an int >= 1"):
        await LLMCall.apply("s", "x", model=rec.model, response_format=PLAN, format_attempts=0)
