"""Cache warming: a step's 16 requests sharing a 1,600-token prefix, with and without.

A step fans out: 16 forward calls (``llm_call``) with one system prompt of 1,600 tokens
and a question each, all sent at the same moment. Providers make a cached prefix
readable only once a first request with it has been worked on (Anthropic: when its
answer begins; OpenAI: when its answer returns), so without warming every request
misses. The fakes here (``TimedAnthropicTestServer``, ``TimedOpenAITestServer``) apply
each provider's documented rule that way: a prefix is readable 50 ms after the request
that wrote it arrived (Anthropic; an answer begins), or once its 200 ms answer is back
(OpenAI); a token is a word. The models are asyncgraph's real clients
(``AnthropicChat(cache_prompt=True)`` at Claude Sonnet 4's rates, ``OpenAIChat`` at
gpt-4o-mini's), ``warm_cache`` off and on (NOTE [Cache warming]).

Prints per provider and setting: the share of the step's input tokens read from cache,
the cache writes, the step's cost, its wall time (the model's limits read and its
connections opened before, as in a job's later steps), and (warming) the cost against no
warming and the wall time it added, in units of one request's latency as the client
measures it (one request sent alone, before the step: the fake's latency and the
client's own time) and of the fake's latency (noisy on a loaded machine: the fakes'
threads share its cores). Goals (#34): >=
85% read from cache, cost <= 0.5x on Anthropic's rates, at most one extra request's
latency. Run: ``python benchmarks/bench_cache_warming.py [--runs 2]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio

from asyncgraph.models import AnthropicChat, OpenAIChat, Pricing, track_usage
from asyncgraph.models._testing_local import TimedAnthropicTestServer, TimedOpenAITestServer
from asyncgraph.text import llm_call

EXAMPLES = 16
PREFIX_TOKENS = 1600
LATENCY_S = 0.2
ANTHROPIC = Pricing(3.00, 15.00, cached_input_usd_per_1m=0.30, cache_write_usd_per_1m=3.75)
OPENAI = Pricing(0.15, 0.60, cached_input_usd_per_1m=0.075)


def system_prompt() -> str:
    words: list[str] = []
    rule = 0
    while len(words) < PREFIX_TOKENS:
        rule += 1
        words += f"Rule {rule}: when a question mentions case {rule}, answer with care.".split()
    return " ".join(words[:PREFIX_TOKENS])


async def step(model: Any) -> dict[str, float]:
    prompt = system_prompt()
    # As in a job's later steps: the model's limits read and its connections open.
    await model.limits()
    async with anyio.create_task_group() as tg:
        for i in range(EXAMPLES):
            tg.start_soon(lambda i=i: model.complete([{"role": "user", "content": f"ping {i}"}]))
    # One request alone, as the client sees it (the fake's latency and the client's own
    # time): the unit of "one extra request's latency".
    lone = time.perf_counter()
    await model.complete([{"role": "user", "content": "one alone"}])
    lone = time.perf_counter() - lone
    started = time.perf_counter()
    with track_usage() as usage:
        async with anyio.create_task_group() as tg:
            for i in range(EXAMPLES):
                tg.start_soon(
                    lambda i=i: llm_call(prompt, f"Question {i}: what is {i} * 7?", model=model)
                )
    wall = time.perf_counter() - started
    total = usage.snapshot()
    return {
        "read": total.cache_read_tokens / total.prompt_tokens,
        "writes": float(total.cache_write_tokens),
        "cost": total.cost_usd,
        "wall": wall,
        "lone": lone,
    }


async def run(provider: str, warm: bool) -> dict[str, float]:
    if provider == "anthropic":
        with TimedAnthropicTestServer(latency_s=LATENCY_S, ready_s=0.05) as server:
            model: Any = AnthropicChat(
                "claude-sonnet-4-20250514",
                base_url=server.url,
                api_key="anthropic-test-key",
                cache_prompt=True,
                pricing=ANTHROPIC,
            )
            model.warm_cache = warm
            async with model:
                return await step(model)
    with TimedOpenAITestServer(latency_s=LATENCY_S) as server:
        model = OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="test", pricing=OPENAI)
        model.warm_cache = warm
        async with model:
            return await step(model)


async def main(runs: int) -> None:
    print(
        f"{EXAMPLES} requests at once sharing a {PREFIX_TOKENS}-token prefix; "
        f"one request takes {LATENCY_S * 1000:.0f} ms"
    )
    for provider in ("anthropic", "openai"):
        for k in range(runs):
            cold = await run(provider, warm=False)
            warm = await run(provider, warm=True)
            for label, r in (("no warming", cold), ("warming", warm)):
                print(
                    f"{provider:>9} run {k + 1} {label:>10}: {r['read']:6.1%} of input read from "
                    f"cache, {r['writes']:7.0f} tokens written, ${r['cost']:.5f}, "
                    f"{r['wall'] * 1000:5.0f} ms"
                )
            added = warm["wall"] - cold["wall"]
            alone = (warm["lone"] + cold["lone"]) / 2
            print(
                f"{provider:>9} run {k + 1} {'':>10}  cost {warm['cost'] / cold['cost']:.2f}x of "
                f"no warming, +{added * 1000:.0f} ms: +{added / alone:.2f} request latencies as "
                f"measured ({alone * 1000:.0f} ms for one request alone), "
                f"+{added / LATENCY_S:.2f} of the fake's {LATENCY_S * 1000:.0f} ms"
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=2)
    anyio.run(main, parser.parse_args().runs)


if __name__ == "__main__":
    cli()
