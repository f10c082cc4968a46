"""A scripted task for the optimizers: instructions that help different examples, some of
which conflict. The search tests use the small version at the end of this file (imported
by name: tests/ has no packages); benchmarks/bench_optimizers.py builds a larger one from
``SkillsTask`` (8 instructions, 2 conflicting pairs, a test split).

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
_ACTION = re.compile(r'(Add|Remove) the instruction: "([^"]+)"')
_TAG = {
    "variable": re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL),
    "a": re.compile(r"<VARIABLE_A>(.*?)</VARIABLE_A>", re.DOTALL),
    "b": re.compile(r"<VARIABLE_B>(.*?)</VARIABLE_B>", re.DOTALL),
    "output_feedback": re.compile(r"<OUTPUT_FEEDBACK>(.*?)</OUTPUT_FEEDBACK>", re.DOTALL),
}


def make_examples(counts: Mapping[str, int], tag: str) -> list[dict[str, Any]]:
    return [
        {"question": f"{tag} {skill} question {i}?", "answer": f"{skill}{i}", "skill": skill}
        for skill, n in counts.items()
        for i in range(n)
    ]


def with_instructions(instructions: Sequence[str]) -> str:
    return " ".join([BASE, *instructions])


class SkillsTask:
    """One version of the task: ``instructions`` by skill, ``conflicts`` (skill -> the
    skill whose instruction spoils it) and ``counts`` (split -> examples per skill);
    ``splits[split]`` holds that split's examples."""

    def __init__(
        self,
        instructions: Mapping[str, str],
        conflicts: Mapping[str, str],
        counts: Mapping[str, Mapping[str, int]],
    ) -> None:
        self.instructions = dict(instructions)
        self.conflicts = dict(conflicts)
        self.splits = {split: make_examples(n, split) for split, n in counts.items()}
        self.rows = {row["question"]: row for rows in self.splits.values() for row in rows}

    def instructions_in(self, prompt: str) -> list[str]:
        return [s for s in self.instructions.values() if s in prompt]

    def _clashes(self, skill: str, text: str | Sequence[str]) -> bool:
        return skill in self.conflicts and self.instructions[self.conflicts[skill]] in text

    def solve(self, prompt: str, question: str) -> str:
        row = self.rows[question.strip()]
        skill = row["skill"]
        knows = self.instructions[skill] in prompt
        return row["answer"] if knows and not self._clashes(skill, prompt) else "unsure"

    def grade(self, answer: str, question: str, prompt: str) -> tuple[float, str]:
        row = self.rows[question.strip()]
        if answer.strip() == row["answer"]:
            return 1.0, ""
        skill = row["skill"]
        if self.instructions[skill] not in prompt:
            return 0.0, f'Wrong. Add the instruction: "{self.instructions[skill]}"'
        return 0.0, f'Wrong. Remove the instruction: "{self.instructions[self.conflicts[skill]]}"'

    def apply_most_named(self, prompt: str, feedback: str) -> str:
        actions = Counter(_ACTION.findall(feedback))
        current = self.instructions_in(prompt)
        if actions:
            # Most frequent action; ties go to the one mentioned first (Counter keeps order).
            (verb, instruction), _ = max(actions.items(), key=lambda item: item[1])
            if verb == "Add" and instruction not in current:
                current.append(instruction)
            elif verb == "Remove" and instruction in current:
                current.remove(instruction)
        return with_instructions(current)

    def merge(self, first: str, second: str) -> str:
        kept = self.instructions_in(first)
        for instruction in self.instructions_in(second):
            skill = next(k for k, v in self.instructions.items() if v == instruction)
            if instruction not in kept and not self._clashes(skill, kept):
                kept.append(instruction)
        return with_instructions(kept)

    def respond(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The scripted model: solver, feedback engine, optimizer and merger in one."""
        system = str(messages[0]["content"]) if messages[0]["role"] == "system" else ""
        text = "\n".join(str(m["content"]) for m in messages)
        if "<VARIABLE_A>" in text:
            first, second = _TAG["a"].findall(text)[-1], _TAG["b"].findall(text)[-1]
            return f"<IMPROVED_VARIABLE>{self.merge(first, second)}</IMPROVED_VARIABLE>"
        if "IMPROVED_VARIABLE" in text:
            current = _TAG["variable"].findall(text)[-1]
            feedback = text.split("<FEEDBACK>", 1)[-1]
            improved = self.apply_most_named(current, feedback)
            return f"<IMPROVED_VARIABLE>{improved}</IMPROVED_VARIABLE>"
        if "<OUTPUT_FEEDBACK>" in text:
            found = _TAG["output_feedback"].findall(text)
            lines = [f'{verb} the instruction: "{s}"' for verb, s in _ACTION.findall(found[-1])]
            return "\n".join(lines) or "No change needed."
        if "give feedback" in text.lower():
            return "No change needed."
        return self.solve(system, str(messages[-1]["content"]))

    def make_model(self, latency_s: float = 0.0) -> SimulatedModel:
        return SimulatedModel(latency_s=latency_s, responder=self.respond, tag_replies=False)

    def accuracy(self, prompt: str, rows: Sequence[Mapping[str, Any]]) -> float:
        return sum(self.solve(prompt, r["question"]) == r["answer"] for r in rows) / len(rows)


class SkillProgram(Module):
    """The solver: one system prompt; ``forward(example)`` returns ``(loss, score)``.
    ``task`` grades it (the tests' ``TASK`` unless given); ``call`` is the solver call."""

    def __init__(
        self,
        model: Any,
        prompt: str = BASE,
        task: SkillsTask | None = None,
        call: type[LLMCall] = LLMCall,
    ) -> None:
        super().__init__()
        self.prompt = Parameter(prompt, role="system prompt")
        self.model = model
        self.task = task or TASK
        self.call = call

    async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
        question = Variable(example["question"], role="question")
        answer: Variable = await self.call.apply(
            self.prompt, question, model=self.model, role="answer"
        )
        prompt = self.prompt.data

        def check(prediction: str) -> tuple[float, str]:
            return self.task.grade(prediction, example["question"], prompt)

        score, loss = await DeterministicEvaluator.apply(check, answer)
        return loss, float(score.data)


# The tests' version: 4 instructions, one conflicting pair.
TASK = SkillsTask(
    {
        "a": "Spell names in full.",
        "b": "Show the unit.",
        "c": "Answer in uppercase.",
        "d": "Answer in lowercase.",
    },
    {"c": "d", "d": "c"},
    {"train": {"a": 4, "b": 4, "c": 4, "d": 2}, "val": {"a": 3, "b": 3, "c": 3, "d": 2}},
)
INSTRUCTIONS = TASK.instructions
TRAIN, VAL = TASK.splits["train"], TASK.splits["val"]
respond, make_model, accuracy = TASK.respond, TASK.make_model, TASK.accuracy
