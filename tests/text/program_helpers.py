"""A three-stage program (planner, solver, critic) and the scripted model it runs on.

Imported by name by the tests (``tests/text`` is on ``sys.path``) and by the fresh
process that loads a saved program (``python -m program_helpers SAVED``, which prints
the program's answers to the questions as JSON).

The scripted model is deterministic and offline. Each stage does its job well only
when its instructions hold one rule:

- the planner lists the numbers and the operation when its prompt holds PLAN_RULE,
  else writes a vague plan;
- the solver computes the result from a plan that lists them, when its prompt holds
  SOLVE_RULE, else estimates ("about 40");
- the critic replies with the draft's number alone when its prompt holds CHECK_RULE,
  else wraps it in a sentence.

The feedback engine traces an evaluator's explanation back, stage by stage, to the
rule that is missing ("Add the rule: ..."; the plan is blamed only once the solver
computes exactly), and the optimizer appends the rules asked for. So TGD learns the
critic's and the solver's rules in one step and the planner's in the next, after
which every answer is exactly right.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from asyncgraph import Module, Parameter, Variable, no_grad
from asyncgraph.models import SimulatedModel
from asyncgraph.text import llm_call, register_model

MODEL = "three-stage-script"
PLAN_RULE = "List the numbers and the operation."
SOLVE_RULE = "Compute the exact result from the plan."
CHECK_RULE = "Reply with the number only."
DATASET = [
    {"question": "What is 6 times 7?", "answer": "42"},
    {"question": "What is 12 plus 30?", "answer": "42"},
    {"question": "What is 9 times 8?", "answer": "72"},
    {"question": "What is 100 minus 1?", "answer": "99"},
]
_OPS = {"times": lambda a, b: a * b, "plus": lambda a, b: a + b, "minus": lambda a, b: a - b}
_QUESTION = re.compile(r"What is (\d+) (times|plus|minus) (\d+)\?")
_PLAN = re.compile(r"numbers: (\d+), (\d+); operation: (\w+)")
_RULE = re.compile(r'Add the rule: "([^"]+)"')


def _tag(text: str, tag: str) -> str:
    found = re.findall(rf"<{tag}>\n?(.*?)\n?</{tag}>", text, re.DOTALL)
    return found[-1].strip() if found else ""


def _forward(system: str, user: str) -> str:
    if system.startswith("You plan"):
        match = _QUESTION.search(user)
        if match and PLAN_RULE in system:
            return f"numbers: {match[1]}, {match[3]}; operation: {match[2]}"
        return "Plan: work it out."
    if system.startswith("You solve"):
        plan = _PLAN.search(user)
        question = _QUESTION.search(user)
        if plan and SOLVE_RULE in system:
            return str(_OPS[plan[3]](int(plan[1]), int(plan[2])))
        exact = _OPS[question[2]](int(question[1]), int(question[3])) if question else 0
        return f"about {round(exact, -1)}"
    # The critic: the final answer from the draft (the last part of its input).
    draft = user.rsplit("\n\n", 1)[-1].strip()
    return draft if CHECK_RULE in system else f"The answer is {draft}."


def _feedback(content: str) -> str:
    role = _tag(content, "ROLE")
    value = _tag(content, "VARIABLE")
    output = _tag(content, "LM_OUTPUT")
    said = _tag(content, "OUTPUT_FEEDBACK")
    expected = re.search(r"should be '(\d+)'", said)
    if role == "the critic instructions":
        if CHECK_RULE not in value and not output.isdigit():
            return f'The final answer must be a bare number. Add the rule: "{CHECK_RULE}"'
        return "No change needed."
    if role == "the draft answer":
        if expected and value != expected[1]:
            return f"The draft answer should be '{expected[1]}', not {value!r}."
        return "No change needed."
    if role == "the solver instructions":
        if expected and SOLVE_RULE not in value:
            return f'The draft is an estimate. Add the rule: "{SOLVE_RULE}"'
        return "No change needed."
    if role == "the plan":
        # Only a solver that computes exactly can tell that the plan is what is missing.
        computes = SOLVE_RULE in _tag(content, "LM_SYSTEM_PROMPT")
        if expected and computes and not _PLAN.search(value):
            return "The plan must list the numbers and the operation."
        return "No change needed."
    if role == "the planner instructions":
        if "must list the numbers" in said and PLAN_RULE not in value:
            return f'The plan is vague. Add the rule: "{PLAN_RULE}"'
        return "No change needed."
    return "No change needed."


def _improve(content: str) -> str:
    current = _tag(content, "VARIABLE")
    wanted = [
        r for r in dict.fromkeys(_RULE.findall(_tag(content, "FEEDBACK"))) if r not in current
    ]
    return f"<IMPROVED_VARIABLE>{' '.join([current, *wanted])}</IMPROVED_VARIABLE>"


def respond(messages: Sequence[Mapping[str, Any]]) -> str:
    """The scripted model's reply to any request of the program, its backward or TGD."""
    content = str(messages[-1]["content"])
    if "IMPROVED_VARIABLE" in content:
        return _improve(content)
    if "<VARIABLE>" in content:
        return _feedback(content)
    system = str(messages[0]["content"]) if messages[0]["role"] == "system" else ""
    return _forward(system, content)


register_model(MODEL, SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False))


class Stage(Module):
    """One LLM call with instructions of its own (its one parameter, ``prompt``)."""

    def __init__(self, instructions: str, role: str, output_role: str) -> None:
        super().__init__()
        self.prompt = Parameter(instructions, role=role)
        self.output_role = output_role

    async def forward(self, *inputs: Variable | str) -> Variable:
        return await llm_call(self.prompt, *inputs, model=MODEL, role=self.output_role)


class ThreeStage(Module):
    """Planner, solver and critic: three named prompts, ``planner.prompt`` and so on."""

    def __init__(self) -> None:
        super().__init__()
        self.planner = Stage("You plan how to answer the question.", "planner instructions", "plan")
        self.solver = Stage("You solve the question.", "solver instructions", "draft answer")
        self.critic = Stage("You check the draft answer.", "critic instructions", "final answer")

    async def forward(self, question: str) -> Variable:
        q = Variable(question, role="question")
        plan = await self.planner(q)
        draft = await self.solver(q, plan)
        return await self.critic(q, draft)


def exact(prediction: str, target: str) -> tuple[float, str]:
    """The metric: exact match, explained."""
    if prediction.strip() == target:
        return 1.0, ""
    return 0.0, f"The final answer should be '{target}', not {prediction!r}."


async def answers(program: ThreeStage) -> list[str]:
    """The program's answers to every question of DATASET, without recording a graph."""
    with no_grad():
        return [str((await program(row["question"])).data) for row in DATASET]


def main(argv: list[str]) -> None:
    """``python -m program_helpers SAVED``: load a saved ThreeStage and print its answers."""
    program = ThreeStage()
    program.load(argv[0])
    print(json.dumps({"answers": anyio.run(answers, program), "state": program.state_dict()}))


if __name__ == "__main__":
    main(sys.argv[1:])
