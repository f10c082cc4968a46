"""A scripted task whose rewrites add one rule at a time. The tests use the small version
at the end of this file (imported by name: tests/ has no packages);
benchmarks/bench_optimizers.py builds a larger one from ``RulesTask`` (8 rules) and runs
``tgd_curve`` on it and on its skills task.

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
_ADD = re.compile(r'Add the rule: "([^"]+)"')
_TAG = {
    "variable": re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL),
    "output_feedback": re.compile(r"<OUTPUT_FEEDBACK>(.*?)</OUTPUT_FEEDBACK>", re.DOTALL),
}


class RulesTask:
    """One version of the task: ``rules`` hidden rules, ``train`` and ``val`` examples;
    example ``i`` of a split follows rule ``i * stride`` (modulo the number of rules)."""

    def __init__(self, rules: int, train: int = 30, val: int = 20, stride: int = 1) -> None:
        self.rules = [f"Rule {k}: follow convention {k}." for k in range(rules)]
        self.stride = stride
        self.train = self.make_examples(train, "train")
        self.val = self.make_examples(val, "val")
        self.rows = {row["question"]: row for row in [*self.train, *self.val]}
        self.best = " ".join([BASE, *self.rules])

    def make_examples(self, n: int, split: str) -> list[dict[str, Any]]:
        count = len(self.rules)
        return [
            {
                "question": f"{split} question {i}?",
                "answer": f"{split}-{i}",
                "rule": i * self.stride % count,
            }
            for i in range(n)
        ]

    def solve(self, prompt: str, question: str) -> str:
        row = self.rows[question.strip()]
        return row["answer"] if self.rules[row["rule"]] in prompt else "unsure"

    def grade(self, answer: str, question: str) -> tuple[float, str]:
        row = self.rows[question.strip()]
        if answer.strip() == row["answer"]:
            return 1.0, ""
        return 0.0, f'Wrong. Add the rule: "{self.rules[row["rule"]]}"'

    def add_most_named(self, prompt: str, feedback: str) -> str:
        """The optimizer model: adds the rule its feedback names most often (one per rewrite)."""
        named = Counter(_ADD.findall(feedback))
        kept = [r for r in self.rules if r in prompt]
        if named:
            rule, _ = max(named.items(), key=lambda item: item[1])
            if rule not in kept:
                kept.append(rule)
        return " ".join([BASE, *sorted(kept, key=self.rules.index)])

    def respond(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The scripted model, for asyncgraph's prompts."""
        system = str(messages[0]["content"]) if messages[0]["role"] == "system" else ""
        text = "\n".join(str(m["content"]) for m in messages)
        if "IMPROVED_VARIABLE" in text:
            current = _TAG["variable"].findall(text)[-1]
            feedback = text.split("<FEEDBACK>", 1)[-1]
            return (
                f"<IMPROVED_VARIABLE>{self.add_most_named(current, feedback)}</IMPROVED_VARIABLE>"
            )
        if "<OUTPUT_FEEDBACK>" in text:
            found = _TAG["output_feedback"].findall(text)[-1]
            return "\n".join(f'Add the rule: "{r}"' for r in _ADD.findall(found)) or "Fine."
        if "give feedback" in text.lower():
            return "Fine."
        return self.solve(system, str(messages[-1]["content"]))

    def make_model(self, latency_s: float = 0.0) -> SimulatedModel:
        return SimulatedModel(latency_s=latency_s, responder=self.respond, tag_replies=False)

    def accuracy(self, prompt: str, rows: Sequence[Mapping[str, Any]]) -> float:
        return sum(self.solve(prompt, r["question"]) == r["answer"] for r in rows) / len(rows)


class RuleProgram(Module):
    """The solver: one system prompt, graded by ``task`` (the tests' ``TASK`` unless given)."""

    def __init__(self, model: Any, task: RulesTask | None = None) -> None:
        super().__init__()
        self.prompt = Parameter(BASE, role="system prompt")
        self.model = model
        self.task = task or TASK

    async def forward(self, example: Mapping[str, Any]) -> tuple[Variable, float]:
        question = Variable(example["question"], role="question")
        answer: Variable = await LLMCall.apply(
            self.prompt, question, model=self.model, role="answer"
        )

        def check(prediction: str) -> tuple[float, str]:
            return self.task.grade(prediction, example["question"])

        score, loss = await DeterministicEvaluator.apply(check, answer)
        return loss, float(score.data)


async def tgd_curve(
    program: Any,
    train: Sequence[Mapping[str, Any]],
    model: Any,
    seed: int,
    limit: int,
    batch_size: int = 8,
    stop: str | None = None,
) -> list[tuple[int, str]]:
    """Plain TGD on batches of ``train`` drawn by ``random.Random(seed)`` until ``limit``
    model calls are spent (or ``program.prompt`` becomes ``stop``): (calls so far, the
    prompt) after each step."""
    tgd = TGD(program.parameters(), model=model)
    rng = random.Random(seed)
    curve: list[tuple[int, str]] = []
    with track_usage() as usage:
        while usage.snapshot().requests < limit:
            batch = rng.sample(train, batch_size)
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
            curve.append((usage.snapshot().requests, program.prompt.data))
            if program.prompt.data == stop:
                break
    return curve


# The tests' version: 6 rules, example i follows rule i.
TASK = RulesTask(6)
TRAIN, VAL, BEST = TASK.train, TASK.val, TASK.best
make_model = TASK.make_model


async def tgd_calls_to_best(seed: int, batch_size: int = 8, limit: int = 2000) -> int | None:
    """Plain TGD on shuffled batches: the model calls spent when its prompt first became
    the best one (None if not within ``limit``)."""
    model = make_model()
    curve = await tgd_curve(RuleProgram(model), TRAIN, model, seed, limit, batch_size, BEST)
    return curve[-1][0] if curve and curve[-1][1] == BEST else None
