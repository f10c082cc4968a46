"""The shipped demo: optimize a system prompt on a small question set.

It runs offline on a *simulated* model (``SimulatedModel`` with a scripted
responder): the "solver" answers each question, better when the system prompt
holds the instruction for that question's skill; the "judge" compares with the
expected answer and, when wrong, says which instruction is missing; feedback
flows back through the judge and the solver to the system prompt; TGD's
"optimizer" call adds the instruction named most often in the batch's feedback.
Nothing here is a language model: it is a deterministic stand-in that shows the
machinery (concurrent forward and backward, feedback in graph order, TGD,
checkpoints), and the output says so. ``--model openai:MODEL`` runs the same
job against a real endpoint.

Importing this module registers the model name ``"demo"``, so workers started
with ``--import asyncgraph.jobs.demo`` resolve it too.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from asyncgraph import Module, Parameter, Variable
from asyncgraph._redact import redact_url

from ..models import SimulatedModel
from ..optim import TGD
from ..text import FormattedLLMCall, LLMCall, TextLoss, register_model
from ._job import Evaluation, Job

__all__ = ["DEMO_MODEL", "build_demo_job", "make_demo_model"]

DEMO_MODEL = "demo"
"""The model name the demo registers (its simulated model) and uses by default.

Example::

    answer = await llm_call(prompt, question, model=DEMO_MODEL)
"""
INITIAL_PROMPT = "You are a helpful assistant."
INSTRUCTIONS = {
    "concise": "Answer with the final answer only, no extra words.",
    "arithmetic": "Multiply digit by digit and double-check the product.",
    "units": "Always write the unit symbol after a number.",
    "spelling": "Reverse words letter by letter.",
}
JUDGE_INSTRUCTION = (
    "You grade answers to short questions. Compare the answer with the expected answer "
    "exactly. Reply 'Correct.' or explain what is wrong and which instruction would fix it."
)
JUDGE_TEMPLATE = "Question: {question}\nExpected answer: {expected}\nAnswer: {answer}"
_SUGGESTION = re.compile(r'Add the instruction: "([^"]+)"')
_VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)
_JUDGE = re.compile(r"Question: (.*)\nExpected answer: (.*)\nAnswer: (.*)", re.DOTALL)


def load_dataset() -> dict[str, Any]:
    """The shipped question set: ``{"train": [...], "val": [...]}``, rows with question/answer/skill."""
    text = resources.files("asyncgraph.jobs").joinpath("data/demo_qa.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


_ROWS: dict[str, dict[str, Any]] = {}


def _row(question: str) -> dict[str, Any] | None:
    if not _ROWS:
        data = load_dataset()
        for row in [*data["train"], *data["val"]]:
            _ROWS[row["question"]] = row
    return _ROWS.get(question.strip())


def _solve(system_prompt: str, question: str) -> str:
    row = _row(question)
    if row is None:
        return f"(simulated solver) I do not know: {question}"
    answer, skill = str(row["answer"]), str(row["skill"])
    knows = INSTRUCTIONS[skill] in system_prompt
    if skill == "concise":
        return answer if knows else f"The capital is {answer}."
    if skill == "arithmetic":
        return answer if knows else str(round(int(answer), -1) + 10)
    if skill == "units":
        return answer if knows else answer.split()[0]
    return answer if knows else answer[1] + answer[0] + answer[2:]


def _judge(content: str) -> str:
    match = _JUDGE.search(content)
    if match is None:
        return "Correct."
    question, expected, answer = (part.strip() for part in match.groups())
    if answer == expected:
        return "Correct."
    row = _row(question)
    fix = f' Add the instruction: "{INSTRUCTIONS[row["skill"]]}"' if row else ""
    return f'Incorrect: expected "{expected}" but the answer was "{answer}".{fix}'


def _improve(everything: str) -> str:
    current = _VARIABLE.findall(everything)[-1].strip()
    feedback = everything.split("<FEEDBACK>", 1)[-1]
    counts = Counter(s for s in _SUGGESTION.findall(feedback) if s not in current)
    if counts:
        # Most frequent suggestion; ties go to the first mentioned (Counter keeps order).
        best = max(counts.items(), key=lambda item: item[1])[0]
        current = f"{current} {best}"
    if '"improved_variable"' in everything:  # asked for with structured outputs
        return json.dumps({"improved_variable": current})
    return f"<IMPROVED_VARIABLE>{current}</IMPROVED_VARIABLE>"


def demo_responder(messages: Sequence[Mapping[str, Any]]) -> str:
    """The scripted replies of the demo's simulated model (see the module docstring)."""
    everything = "\n".join(str(m.get("content", "")) for m in messages)
    system = (
        str(messages[0].get("content", ""))
        if messages and messages[0].get("role") == "system"
        else ""
    )
    if "IMPROVED_VARIABLE" in everything.upper():  # tags, or the JSON field
        return _improve(everything)
    if "You condense feedback" in system:
        suggestions = dict.fromkeys(_SUGGESTION.findall(everything))
        return "\n".join(f'Add the instruction: "{s}"' for s in suggestions) or "No change needed."
    if "feedback engine" in system:
        variable = (_VARIABLE.findall(everything) or [""])[-1]
        wanted = [s for s in dict.fromkeys(_SUGGESTION.findall(everything)) if s not in variable]
        return "\n".join(f'Add the instruction: "{s}"' for s in wanted) or "No change needed."
    if system.startswith("You grade answers"):
        return _judge(str(messages[-1].get("content", "")))
    return _solve(system, str(messages[-1].get("content", "")))


LATENCY_ENV = "ASYNCGRAPH_DEMO_LATENCY_MS"


def make_demo_model(latency_s: float | None = None) -> SimulatedModel:
    """The demo's simulated model; latency from ``$ASYNCGRAPH_DEMO_LATENCY_MS`` (default 100 ms).

    Example::

        model = make_demo_model(latency_s=0)
        answer = await model.complete([{"role": "user", "content": "Label the number 7."}])
    """
    if latency_s is None:
        latency_s = float(os.environ.get(LATENCY_ENV, "100")) / 1000
    return SimulatedModel(latency_s=latency_s, responder=demo_responder, tag_replies=False)


register_model(DEMO_MODEL, make_demo_model())


class DemoAnswer(LLMCall):
    """The demo's solver call: an :class:`LLMCall` of its own, so this module serves something.

    ``asyncgraph worker --import asyncgraph.jobs.demo`` accepts only modules that
    define remote Functions; importing this one there also registers the
    ``"demo"`` model the backward's feedback requests resolve.
    """


class DemoJudge(FormattedLLMCall):
    """The demo's judge call (see :class:`DemoAnswer`)."""


class DemoProgram(Module):
    """The demo's program: a solver with a system prompt, graded by a judge.

    ``system_prompt`` is its one parameter; ``await program(example)`` answers the
    example's question and returns its :class:`Evaluation` (the judge's verdict is
    the loss, exact match the score).
    """

    def __init__(self, model: str = DEMO_MODEL, base_url: str | None = None) -> None:
        super().__init__()
        self.system_prompt = Parameter(
            INITIAL_PROMPT, role="system prompt of the question answerer"
        )
        self.model = model
        self.base_url = base_url
        self.judge = TextLoss(
            JUDGE_INSTRUCTION,
            model=model,
            template=JUDGE_TEMPLATE,
            base_url=base_url,
            function=DemoJudge,
        )

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        question = Variable(example["question"], role="question")
        options: dict[str, Any] = {"model": self.model, "role": "answer"}
        if self.base_url is not None:
            options["base_url"] = self.base_url
        answer: Variable = await DemoAnswer.apply(self.system_prompt, question, **options)
        expected = Variable(example["answer"], role="expected answer")
        loss = await self.judge(question=question, expected=expected, answer=answer)
        score = float(str(answer.data).strip() == example["answer"])
        return Evaluation(loss=loss, score=score, prediction=answer.data)


def build_demo_job(
    model: str = DEMO_MODEL,
    *,
    base_url: str | None = None,
    batch_size: int = 8,
    epochs: int = 2,
    seed: int = 0,
    latency_ms: float | None = None,
) -> tuple[Job, Parameter]:
    """The demo job and its parameter (the system prompt of its :class:`DemoProgram`).

    ``latency_ms``, with the simulated ``"demo"`` model: each of its calls takes that
    long (the model is registered anew, for this process); None keeps the latency it has
    (``$ASYNCGRAPH_DEMO_LATENCY_MS``, default 100 ms). Its ``config`` (part of what a
    checkpoint must match to be resumed) holds the model spec, ``base_url`` (redacted),
    ``latency_ms``, epochs, batch size and the optimizer's settings.

    Example::

        job, prompt = build_demo_job(epochs=1)
        result = await run_job(job, "runs/demo", progress=False)
        print(prompt.data, result.final_val_score)
    """
    if model == DEMO_MODEL and latency_ms is not None:
        register_model(DEMO_MODEL, make_demo_model(latency_ms / 1000))
    data = load_dataset()
    program = DemoProgram(model, base_url)
    prompt = program.system_prompt
    optimizer = TGD(program.parameters(), model=model, base_url=base_url, momentum=2)
    (group,) = optimizer.state_dict()["param_groups"]
    config = {
        "model": model,
        # Redacted: the config is written in every checkpoint and history, and a URL's
        # credentials do not change the job (the model is built from ``base_url`` itself).
        "base_url": redact_url(base_url) if base_url is not None else None,
        "latency_ms": latency_ms,
        "epochs": epochs,
        "batch_size": batch_size,
        "optimizer": {
            "name": type(optimizer).__name__,
            **{key: value for key, value in group.items() if key != "params"},
        },
    }
    job = Job(
        name="demo-prompt-optimization",
        parameters=program,
        optimizer=optimizer,
        forward=program,
        train_set=data["train"],
        val_set=data["val"],
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        max_concurrency=32,
        config=config,
    )
    return job, prompt
