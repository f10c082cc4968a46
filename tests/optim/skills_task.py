"""A scripted task for the search tests: instructions that help different examples, some
of which conflict (imported by name: tests/ has no packages).

Each example needs one skill; the solver answers it right when the system prompt holds
that skill's instruction and not the instruction that conflicts with it. The evaluator
(code, no model) says which instruction to add or remove; the feedback model passes that
on to the prompt; the optimizer model applies the action named most often; the merge
request keeps the first version's instructions and adds the second's that do not
conflict with them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from asyncgraph import Module, Parameter, Variable
from asyncgraph.models import SimulatedModel
from asyncgraph.text import DeterministicEvaluator, LLMCall

BASE = "You answer questions."
INSTRUCTIONS = {
    "a": "Spell names in full.",
    "b": "Show the unit.",
    "c": "Answer in uppercase.",
    "d": "Answer in lowercase.",
}
CONFLICTS = {"c": "d", "d": "c"}
_ACTION = re.compile(r'(Add|Remove) the instruction: "([^"]+)"')
_TAG = {
    "variable": re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL),
    "a": re.compile(r"<VARIABLE_A>(.*?)</VARIABLE_A>", re.DOTALL),
    "b": re.compile(r"<VARIABLE_B>(.*?)</VARIABLE_B>", re.DOTALL),
    "output_feedback": re.compile(r"<OUTPUT_FEEDBACK>(.*?)</OUTPUT_FEEDBACK>", re.DOTALL),
}


def make_examples(counts: Mapping[str, int], tag: str) -> list[dict[str, Any]]:
    rows = []
    for skill, n in counts.items():
        for i in range(n):
            rows.append(
                {
                    "question": f"{tag} {skill} question {i}?",
                    "answer": f"{skill}{i}",
                    "skill": skill,
                }
            )
    return rows


TRAIN = make_examples({"a": 4, "b": 4, "c": 4, "d": 2}, "train")
VAL = make_examples({"a": 3, "b": 3, "c": 3, "d": 2}, "val")
ROWS = {row["question"]: row for row in [*TRAIN, *VAL]}


def instructions_in(prompt: str) -> list[str]:
    return [s for s in INSTRUCTIONS.values() if s in prompt]


def with_instructions(instructions: Sequence[str]) -> str:
    return " ".join([BASE, *instructions])


def solve(prompt: str, question: str) -> str:
    row = ROWS[question.strip()]
    skill = row["skill"]
    knows = INSTRUCTIONS[skill] in prompt
    conflicted = skill in CONFLICTS and INSTRUCTIONS[CONFLICTS[skill]] in prompt
    return row["answer"] if knows and not conflicted else "unsure"


def grade(answer: str, question: str, prompt: str) -> tuple[float, str]:
    row = ROWS[question.strip()]
    if answer.strip() == row["answer"]:
        return 1.0, ""
    skill = row["skill"]
    if INSTRUCTIONS[skill] not in prompt:
        return 0.0, f'Wrong. Add the instruction: "{INSTRUCTIONS[skill]}"'
    return 0.0, f'Wrong. Remove the instruction: "{INSTRUCTIONS[CONFLICTS[skill]]}"'


def apply_most_named(prompt: str, feedback: str) -> str:
    actions = Counter(_ACTION.findall(feedback))
    current = instructions_in(prompt)
    if actions:
        # Most frequent action; ties go to the one mentioned first (Counter keeps order).
        (verb, instruction), _ = max(actions.items(), key=lambda item: item[1])
        if verb == "Add" and instruction not in current:
            current.append(instruction)
        elif verb == "Remove" and instruction in current:
            current.remove(instruction)
    return with_instructions(current)


def merge(first: str, second: str) -> str:
    kept = instructions_in(first)
    for instruction in instructions_in(second):
        skill = next(k for k, v in INSTRUCTIONS.items() if v == instruction)
        clash = skill in CONFLICTS and INSTRUCTIONS[CONFLICTS[skill]] in kept
        if instruction not in kept and not clash:
            kept.append(instruction)
    return with_instructions(kept)


def respond(messages: list[dict[str, Any]]) -> str:
    """The scripted model: solver, feedback engine, optimizer and merger in one."""
    system = str(messages[0]["content"]) if messages[0]["role"] == "system" else ""
    text = "\n".join(str(m["content"]) for m in messages)
    if "<VARIABLE_A>" in text:
        first, second = _TAG["a"].findall(text)[-1], _TAG["b"].findall(text)[-1]
        return f"<IMPROVED_VARIABLE>{merge(first, second)}</IMPROVED_VARIABLE>"
    if "IMPROVED_VARIABLE" in text:
        current = _TAG["variable"].findall(text)[-1]
        feedback = text.split("<FEEDBACK>", 1)[-1]
        return f"<IMPROVED_VARIABLE>{apply_most_named(current, feedback)}</IMPROVED_VARIABLE>"
    if "<OUTPUT_FEEDBACK>" in text:
        found = _TAG["output_feedback"].findall(text)
        lines = [f'{verb} the instruction: "{s}"' for verb, s in _ACTION.findall(found[-1])]
        return "\n".join(lines) or "No change needed."
    if "give feedback" in text.lower():
        return "No change needed."
    return solve(system, str(messages[-1]["content"]))


def make_model(latency_s: float = 0.0) -> SimulatedModel:
    return SimulatedModel(latency_s=latency_s, responder=respond, tag_replies=False)


class SkillProgram(Module):
    """The solver: one system prompt; ``forward(example)`` returns ``(loss, score)``."""

    def __init__(self, model: Any, prompt: str = BASE) -> None:
        super().__init__()
        self.prompt = Parameter(prompt, role="system prompt")
        self.model = model

    async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
        question = Variable(example["question"], role="question")
        answer: Variable = await LLMCall.apply(
            self.prompt, question, model=self.model, role="answer"
        )
        prompt = self.prompt.data

        def check(prediction: str) -> tuple[float, str]:
            return grade(prediction, example["question"], prompt)

        score, loss = await DeterministicEvaluator.apply(check, answer)
        return loss, float(score.data)


def accuracy(prompt: str, rows: Sequence[Mapping[str, Any]]) -> float:
    return sum(solve(prompt, r["question"]) == r["answer"] for r in rows) / len(rows)
