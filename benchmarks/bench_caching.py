"""Prompt caching: the input tokens of one TGD step served from the provider's cache.

A TGD step of 16 examples, with a system prompt of 1,500 tokens: 16 forward calls
(the prompt and a question), 16 judges (``TextLoss``), the backward's feedback
requests (on each answer, then on the prompt through each call) and TGD's update
request. The models are asyncgraph's real clients (``OpenAIChat`` with gpt-4o-mini's
prices, ``AnthropicChat(cache_prompt=True)`` with Claude Sonnet 4's) against the local
fakes, which apply each provider's documented caching rule: OpenAI caches an identical
prefix of 1,024 tokens or more in 128-token steps (``OpenAITestServer(prompt_cache=
True)``); Anthropic caches up to a ``cache_control`` mark, when that prefix is 1,024
tokens or more (``AnthropicTestServer(min_cache_tokens=1024)``). A token is a word in
the fakes.

"before" sends the feedback requests as asyncgraph built them until the shared-prefix
order (``legacy_feedback_messages`` below: the variable under review last, after the
call's input and output, and no ``cache_control`` mark but the system prompt's);
"after" is asyncgraph's order and marks today (NOTE [Shared prefix
first] in ``asyncgraph/text/_prompts.py``). Each run uses fresh servers (an empty
cache). Prints, per provider and order: the fraction of the step's input tokens read
from cache (all requests, the first one included), the cache writes, and the step's
cost. Run: ``python benchmarks/bench_caching.py [--runs 2]``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio

import asyncgraph.text._functions as text_functions
from asyncgraph import Parameter, Variable, backward
from asyncgraph.models import AnthropicChat, OpenAIChat, Pricing
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.models._testing_providers import AnthropicTestServer
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, llm_call

EXAMPLES = 16
PROMPT_TOKENS = 1500
OPENAI_PRICING = Pricing(0.15, 0.60, cached_input_usd_per_1m=0.075)  # gpt-4o-mini
ANTHROPIC_PRICING = Pricing(  # Claude Sonnet 4, 5-minute cache writes
    3.00, 15.00, cached_input_usd_per_1m=0.30, cache_write_usd_per_1m=3.75
)
JUDGE = "You grade answers to arithmetic questions. Reply 'Correct.' or say what is wrong."
_VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)


def system_prompt() -> str:
    """1,500 words of rules (a word is a token in the fakes)."""
    words = []
    rule = 0
    while len(words) < PROMPT_TOKENS:
        rule += 1
        words += f"Rule {rule}: when a question mentions case {rule}, answer with care.".split()
    return " ".join(words[:PROMPT_TOKENS])


def _text(body: Any) -> str:
    """Every text of a request, OpenAI- or Anthropic-shaped."""
    parts: list[Any] = []
    system = body.get("system")
    parts += [system] if isinstance(system, str) else list(system or [])
    for message in body.get("messages", []):
        content = message["content"]
        parts += [content] if isinstance(content, str) else list(content)
    return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in parts)


def answer(body: Any) -> Reply:
    """The scripted model: short answers, judges, feedback, and an update."""
    text = _text(body)
    if "IMPROVED_VARIABLE" in text:
        current = _VARIABLE.findall(text)[-1]
        return Reply(text=f"<IMPROVED_VARIABLE>{current} Show the steps.</IMPROVED_VARIABLE>")
    if "feedback engine" in text:
        return Reply(text="Add a rule asking for the steps of the computation.")
    if text.startswith("You grade"):
        return Reply(text="Incorrect: the answer gives no steps.")
    return Reply(text="The answer is 42.")


def legacy_feedback_messages(
    *,
    system_prompt: str | None,
    user_prompt: str,
    output: str,
    output_role: str,
    variable: str,
    variable_role: str,
    feedback: str,
    mark_shared: bool = False,
) -> list[dict[str, Any]]:
    """The feedback request as asyncgraph built it before the shared-prefix order (no
    mark either: ``mark_shared`` is ignored)."""
    from asyncgraph.text._prompts import _NO_FEEDBACK, FEEDBACK_SYSTEM_PROMPT

    conversation = []
    if system_prompt is not None:
        conversation.append(f"<LM_SYSTEM_PROMPT>\n{system_prompt}\n</LM_SYSTEM_PROMPT>")
    conversation.append(f"<LM_INPUT>\n{user_prompt}\n</LM_INPUT>")
    conversation.append(f"<LM_OUTPUT>\n{output}\n</LM_OUTPUT>")
    about_output = (
        f"Here is the feedback on {output_role} (the output of the call above):\n"
        f"<OUTPUT_FEEDBACK>\n{feedback}\n</OUTPUT_FEEDBACK>"
        if feedback
        else _NO_FEEDBACK
    )
    user = (
        f"You will give feedback on a variable with the role <ROLE>{variable_role}</ROLE>.\n\n"
        f"It was used in this call to a language model, which may be one step of a larger "
        f"system:\n\n" + "\n".join(conversation) + "\n\n"
        f"The output of this call is {output_role}.\n\n{about_output}\n\n"
        f"Give feedback on {variable_role}, which is the following text:\n"
        f"<VARIABLE>{variable}</VARIABLE>\n\n"
        f"Describe how {variable_role} should change to improve the output."
    )
    return [
        {"role": "system", "content": FEEDBACK_SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]


@contextmanager
def order(before: bool) -> Iterator[None]:
    if not before:
        yield
        return
    kept = text_functions.llm_feedback_messages
    text_functions.llm_feedback_messages = legacy_feedback_messages  # type: ignore[assignment]
    try:
        yield
    finally:
        text_functions.llm_feedback_messages = kept


async def tgd_step(model: Any) -> None:
    prompt = Parameter(system_prompt(), role="system prompt")
    judge = TextLoss(JUDGE, model=model)
    losses: list[Variable] = [Variable("") for _ in range(EXAMPLES)]

    async def example(i: int) -> None:
        question = Variable(f"What is {i + 2} times {i + 3}?", role="question")
        reply = await llm_call(prompt, question, model=model, role="answer")
        losses[i] = await judge(reply)

    async with anyio.create_task_group() as tg:
        for i in range(EXAMPLES):
            tg.start_soon(example, i)
    optimizer = TGD([prompt], model=model)
    await backward(losses)
    await optimizer.step()


async def measure(provider: str, before: bool) -> dict[str, float]:
    server: OpenAITestServer
    if provider == "openai":
        server = OpenAITestServer(prompt_cache=True, handler=answer)
    else:
        server = AnthropicTestServer(min_cache_tokens=1024, handler=answer)
    with server, order(before):
        model: Any
        if provider == "openai":
            model = OpenAIChat(
                "gpt-4o-mini", base_url=server.url, api_key="sk-test", pricing=OPENAI_PRICING
            )
        else:
            model = AnthropicChat(
                "claude-sonnet-4",
                base_url=server.url,
                api_key="anthropic-test-key",
                cache_prompt=True,
                pricing=ANTHROPIC_PRICING,
            )
        async with model:
            await tgd_step(model)
            usage = model.usage.snapshot()
    return {
        "requests": len(server.requests),
        "input": usage.prompt_tokens,
        "read": usage.cache_read_tokens,
        "written": usage.cache_write_tokens,
        "cost": usage.cost_usd or 0.0,
    }


async def main(runs: int) -> None:
    print(
        f"TGD step: {EXAMPLES} examples, a {PROMPT_TOKENS}-token system prompt "
        "(fraction = input tokens read from cache / all input tokens)"
    )
    for run in range(1, runs + 1):
        for provider in ("openai", "anthropic"):
            found = {
                when: await measure(provider, when == "before") for when in ("before", "after")
            }
            for when, r in found.items():
                print(
                    f"run {run} {provider:9} {when:6}: {r['requests']:.0f} requests, "
                    f"{r['input']:,.0f} input tokens, {r['read'] / r['input']:.0%} read from "
                    f"cache, {r['written']:,.0f} written, ${r['cost']:.5f} per step"
                )
            ratio = found["after"]["cost"] / found["before"]["cost"]
            print(f"run {run} {provider:9} cost after / before: {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=2)
    anyio.run(main, parser.parse_args().runs)
