"""An example job file: optimize the system prompt of a support-ticket router.

Run it with::

    asyncgraph run examples/prompt_job.py --out runs/ticket-router
    asyncgraph run examples/prompt_job.py --out runs/ticket-router --resume     # after Ctrl-C
    asyncgraph run examples/prompt_job.py --out runs/ticket-router --overwrite  # start over

``asyncgraph run`` imports this file, calls ``build_job()`` and runs the job on
the ``TicketRouter`` Module below: mini-batches of tickets, a concurrent forward (router call, then a judge call
per ticket), ``await backward`` over the batch's judgements, a TGD step on the
system prompt, validation every other step, a checkpoint after every step, and
``history.json`` / ``metrics.png`` in the output directory.

By default the model is *simulated*: a ``SimulatedModel`` with a scripted
``respond`` below, offline and deterministic. It is not a language model; it
plays the parts a real one would (the router follows the rules its system prompt
states, the judge names the rule a wrong label was missing, the feedback calls
pass that on, TGD adds the rule asked for most often), so the run shows what the
machinery does in a few seconds. To use a real OpenAI-compatible endpoint set::

    PROMPT_JOB_MODEL=openai:gpt-4o-mini OPENAI_API_KEY=... asyncgraph run examples/prompt_job.py

(``PROMPT_JOB_BASE_URL`` for another server). With a spec like that the
backward can also run on workers: ``asyncgraph worker --redis URL --import
asyncgraph.text`` on each machine, then ``asyncgraph run examples/prompt_job.py
--redis URL --queue grads``. The simulated model lives in this process only.

Copy this file and change the dataset, the prompts and ``score`` to fit your task.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from asyncgraph import Module, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.models import SimulatedModel
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, llm_call, register_model

SIMULATED = "simulated-ticket-router"
MODEL = os.environ.get("PROMPT_JOB_MODEL", SIMULATED)
BASE_URL = os.environ.get("PROMPT_JOB_BASE_URL") or None
LATENCY_MS = float(os.environ.get("PROMPT_JOB_LATENCY_MS", "30"))

LABELS = ("billing", "bug", "account", "feature")
INITIAL_PROMPT = "You route customer support tickets to the right team."
JUDGE_INSTRUCTION = (
    "You check the label a router gave a support ticket. Compare it with the expected "
    "label exactly. Reply 'Correct.' or say what is wrong and which rule, added to the "
    "router's instructions, would fix it."
)
JUDGE_TEMPLATE = "Ticket: {ticket}\nExpected label: {expected}\nPredicted label: {prediction}"

TRAIN = [
    {"ticket": "I was charged twice for my March invoice.", "label": "billing"},
    {"ticket": "The app crashes when I open the settings page.", "label": "bug"},
    {"ticket": "I forgot my password and the reset email never arrives.", "label": "account"},
    {"ticket": "Could you add a dark mode to the dashboard?", "label": "feature"},
    {"ticket": "Please refund the annual plan I cancelled yesterday.", "label": "billing"},
    {"ticket": "Export to CSV fails with error 500.", "label": "bug"},
    {"ticket": "How do I change the email address on my profile?", "label": "account"},
    {"ticket": "It would be great to schedule reports weekly.", "label": "feature"},
    {"ticket": "My credit card was declined but the bank says it is fine.", "label": "billing"},
    {"ticket": "Search returns nothing since the last update.", "label": "bug"},
    {"ticket": "The two-factor code is never accepted when I log in.", "label": "account"},
    {"ticket": "Please support single sign-on with Okta.", "label": "feature"},
    {"ticket": "Why does my invoice show VAT twice?", "label": "billing"},
    {"ticket": "Uploading a photo freezes the page.", "label": "bug"},
    {"ticket": "I want to delete my account and all my data.", "label": "account"},
    {"ticket": "Can the mobile app work offline?", "label": "feature"},
]
VALIDATION = [
    {"ticket": "I need a copy of last year's receipts for my accountant.", "label": "billing"},
    {"ticket": "The calendar shows every meeting one hour late.", "label": "bug"},
    {"ticket": "My username still shows my old company name.", "label": "account"},
    {"ticket": "Could you integrate with Microsoft Teams?", "label": "feature"},
    {"ticket": "I was billed after my trial ended although I cancelled.", "label": "billing"},
    {"ticket": "Notifications stopped working on Android.", "label": "bug"},
    {"ticket": "I am locked out after too many login attempts.", "label": "account"},
    {"ticket": "Please let us tag tickets with custom colours.", "label": "feature"},
]


def score(prediction: str, expected: str) -> float:
    """The metric: exact match of the label (1.0 or 0.0)."""
    return float(prediction.strip() == expected)


# --- The simulated model: scripted replies standing in for an LLM ------------------------

RULES = {
    "format": "Reply with one lowercase label only: billing, bug, account or feature.",
    "billing": "Charges, invoices, refunds and payments are billing.",
    "bug": "Errors, crashes and anything that stopped working are bug.",
    "account": "Logins, passwords, two-factor codes and profile details are account.",
    "feature": "Requests for something the product does not do yet are feature.",
}
# What the simulated router answers for a ticket whose rule its prompt lacks.
CONFUSED_WITH = {"billing": "account", "bug": "feature", "account": "bug", "feature": "bug"}
_LABEL_OF = {row["ticket"]: row["label"] for row in [*TRAIN, *VALIDATION]}
_SUGGESTION = re.compile(r'Add the rule: "([^"]+)"')
_VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)
_FEEDBACK = re.compile(r"<FEEDBACK>(.*?)</FEEDBACK>", re.DOTALL)
_JUDGED = re.compile(r"Ticket: (.*)\nExpected label: (.*)\nPredicted label: (.*)", re.DOTALL)


def _route(system_prompt: str, ticket: str) -> str:
    label = _LABEL_OF.get(ticket.strip())
    if label is None:
        return "I cannot tell which team this ticket belongs to."
    guess = label if RULES[label] in system_prompt else CONFUSED_WITH[label]
    return guess if RULES["format"] in system_prompt else f"This looks like a {guess} issue."


def _judge(content: str) -> str:
    match = _JUDGED.search(content)
    if match is None:
        return "Correct."
    ticket, expected, predicted = (part.strip() for part in match.groups())
    if predicted == expected:
        return "Correct."
    fixes = []
    if predicted not in LABELS:
        fixes.append(RULES["format"])
    if expected not in predicted.split() and expected in RULES:
        fixes.append(RULES[expected])
    advice = " ".join(f'Add the rule: "{fix}"' for fix in fixes)
    return (
        f'Wrong: the ticket {ticket!r} is "{expected}" but the router said "{predicted}". {advice}'
    )


def _improve(request: str) -> str:
    current = _VARIABLE.findall(request)[-1].strip()
    feedback = " ".join(_FEEDBACK.findall(request)[:1])
    wanted = Counter(s for s in _SUGGESTION.findall(feedback) if s not in current)
    if wanted:
        # One edit per step: the rule asked for most often (ties: the first one asked for).
        current = f"{current} {max(wanted.items(), key=lambda item: item[1])[0]}"
    return f"<IMPROVED_VARIABLE>{current}</IMPROVED_VARIABLE>"


def respond(messages: Sequence[Mapping[str, Any]]) -> str:
    """The simulated model's reply, by which part of the job is asking."""
    everything = "\n".join(str(m.get("content", "")) for m in messages)
    first = messages[0] if messages else {}
    system = str(first.get("content", "")) if first.get("role") == "system" else ""
    last = str(messages[-1].get("content", "")) if messages else ""
    if "IMPROVED_VARIABLE" in everything:  # TGD asks for the new prompt
        return _improve(everything)
    if "You condense feedback" in system or "feedback engine" in system:  # backward
        variable = (_VARIABLE.findall(everything) or [""])[-1]
        wanted = [s for s in dict.fromkeys(_SUGGESTION.findall(everything)) if s not in variable]
        return " ".join(f'Add the rule: "{s}"' for s in wanted) or "No change needed."
    if system == JUDGE_INSTRUCTION:
        return _judge(last)
    return _route(system, last)


# --- The job ----------------------------------------------------------------------------


class TicketRouter(Module):
    """The program being optimized: one prompt (its parameter), a router call and a judge.

    ``await router(example)`` labels the example's ticket and returns its
    ``Evaluation``. After the job, ``router.load_state_dict(checkpoint["module"])``
    puts the learned prompt into a fresh ``TicketRouter`` (``router.save(path)`` /
    ``router.load(path)`` keep it in a file of its own).
    """

    def __init__(self) -> None:
        super().__init__()
        self.prompt = Parameter(INITIAL_PROMPT, role="system prompt of the ticket router")
        self.judge = TextLoss(
            JUDGE_INSTRUCTION, model=MODEL, template=JUDGE_TEMPLATE, base_url=BASE_URL
        )

    async def forward(self, example: Mapping[str, Any]) -> Evaluation:
        ticket = Variable(example["ticket"], role="support ticket")
        prediction = await llm_call(
            self.prompt, ticket, model=MODEL, base_url=BASE_URL, role="predicted label"
        )
        expected = Variable(example["label"], role="expected label")
        loss = await self.judge(ticket=ticket, expected=expected, prediction=prediction)
        return Evaluation(
            loss=loss,
            score=score(str(prediction.data), example["label"]),
            prediction=prediction.data,
        )


def build_job() -> Job:
    """The job ``asyncgraph run`` runs: called once per run (and once more on --resume)."""
    if MODEL == SIMULATED:
        register_model(
            SIMULATED,
            SimulatedModel(latency_s=LATENCY_MS / 1000, responder=respond, tag_replies=False),
        )
    router = TicketRouter()
    return Job(
        name="ticket-router",
        parameters=router,  # the checkpoint holds router.state_dict(); resume loads it back
        optimizer=TGD(router.parameters(), model=MODEL, base_url=BASE_URL, momentum=2),
        forward=router,
        train_set=TRAIN,
        val_set=VALIDATION,
        batch_size=4,
        epochs=3,
        validate_every=2,
        max_concurrency=16,
        seed=7,
        # Settings that change the results: --resume refuses a checkpoint made with others.
        config={"model": MODEL, "base_url": BASE_URL, "judge": JUDGE_INSTRUCTION},
    )
