"""A scripted task whose rewrites add one rule at a time (imported by name: tests/ has no
packages); a small version of the task in benchmarks/bench_optimizers.py.

Each example follows one hidden rule; the solver answers it right when the system prompt
states that rule. The evaluator (code) names the missing rule, the feedback model passes
that on, and the optimizer model adds the rule named most often in its feedback: one rule
per rewrite, so reaching the best prompt takes one accepted step per rule.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from asyncgraph import Module, Parameter, Variable, backward, graph_order
from asyncgraph.models import SimulatedModel, track_usage
from asyncgraph.optim import TGD
from asyncgraph.text import DeterministicEvaluator, LLMCall

BASE = "Answer the question."
RULES = [f"Rule {k}: follow convention {k}." for k in range(6)]
_ADD = re.compile(r'Add the rule: "([^"]+)"')
_TAG = {
    "variable": re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL),
    "output_feedback": re.compile(r"<OUTPUT_FEEDBACK>(.*?)</OUTPUT_FEEDBACK>", re.DOTALL),
}


def make_examples(n: int, split: str) -> list[dict[str, Any]]:
    return [
        {"question": f"{split} question {i}?", "answer": f"{split}-{i}", "rule": i % len(RULES)}
        for i in range(n)
    ]


TRAIN = make_examples(30, "train")
VAL = make_examples(20, "val")
ROWS = {row["question"]: row for row in [*TRAIN, *VAL]}
BEST = " ".join([BASE, *RULES])


def solve(prompt: str, question: str) -> str:
    row = ROWS[question.strip()]
    return row["answer"] if RULES[row["rule"]] in prompt else "unsure"


def grade(answer: str, question: str) -> tuple[float, str]:
    row = ROWS[question.strip()]
    if answer.strip() == row["answer"]:
        return 1.0, ""
    return 0.0, f'Wrong. Add the rule: "{RULES[row["rule"]]}"'


def add_most_named(prompt: str, feedback: str) -> str:
    named = Counter(_ADD.findall(feedback))
    kept = [r for r in RULES if r in prompt]
    if named:
        rule, _ = max(named.items(), key=lambda item: item[1])
        if rule not in kept:
            kept.append(rule)
    return " ".join([BASE, *sorted(kept, key=RULES.index)])


def respond(messages: list[dict[str, Any]]) -> str:
    system = str(messages[0]["content"]) if messages[0]["role"] == "system" else ""
    text = "\n".join(str(m["content"]) for m in messages)
    if "IMPROVED_VARIABLE" in text:
        current = _TAG["variable"].findall(text)[-1]
        feedback = text.split("<FEEDBACK>", 1)[-1]
        return f"<IMPROVED_VARIABLE>{add_most_named(current, feedback)}</IMPROVED_VARIABLE>"
    if "<OUTPUT_FEEDBACK>" in text:
        found = _TAG["output_feedback"].findall(text)[-1]
        return "\n".join(f'Add the rule: "{r}"' for r in _ADD.findall(found)) or "Fine."
    if "give feedback" in text.lower():
        return "Fine."
    return solve(system, str(messages[-1]["content"]))


def make_model() -> SimulatedModel:
    return SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False)


class RuleProgram(Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.prompt = Parameter(BASE, role="system prompt")
        self.model = model

    async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
        question = Variable(example["question"], role="question")
        answer: Variable = await LLMCall.apply(
            self.prompt, question, model=self.model, role="answer"
        )

        def check(prediction: str) -> tuple[float, str]:
            return grade(prediction, example["question"])

        score, loss = await DeterministicEvaluator.apply(check, answer)
        return loss, float(score.data)


def accuracy(prompt: str, rows: Sequence[Mapping[str, Any]]) -> float:
    return sum(solve(prompt, r["question"]) == r["answer"] for r in rows) / len(rows)


async def tgd_calls_to_best(seed: int, batch_size: int = 8, limit: int = 2000) -> int | None:
    """Plain TGD on shuffled batches: the model calls spent when its prompt first became
    the best one (None if not within ``limit``)."""
    model = make_model()
    program = RuleProgram(model)
    tgd = TGD(program.parameters(), model=model)
    rng = random.Random(seed)
    with track_usage() as usage:
        while usage.snapshot().requests < limit:
            batch = rng.sample(TRAIN, batch_size)
            results: list[tuple[Variable, float]] = [(Variable(""), 0.0)] * len(batch)

            async def one(i: int, batch: Sequence[Any] = batch, out: list[Any] = results) -> None:
                with graph_order(i):
                    out[i] = await program(batch[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(batch)):
                    tg.start_soon(one, i)
            failing = [loss for loss, score in results if score < 1]
            tgd.zero_grad()
            if failing:
                await backward(failing)
                await tgd.step()
            if program.prompt.data == BEST:
                return usage.snapshot().requests
    return None
