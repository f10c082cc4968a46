"""A real local model behind an OpenAI-compatible server: does the whole loop run?

Against ``--url`` (llama.cpp's ``llama-server``, vLLM, Ollama...: the base URL, e.g.
``http://127.0.0.1:8080/v1``), or, without it, against ``LocalModelTestServer`` (a local
fake that answers like a small model: prose, no tags, JSON only where a schema forces it,
4 slots of 2,048 tokens, llama.cpp's errors), it runs:

1. the README's first script (an answer, a judge, the backward, one TGD step) with the
   update asked for between tags (``TGD(structured=False)``) and with structured
   outputs (``structured=True``), and prints each update's parse outcome;
2. the demo job (one epoch) with the model's ``max_concurrency`` at 1 and at 4 (the
   concurrency a server with 4 slots gives), and prints per run: wall time, model calls,
   completion tokens per second, timeouts (attempts that timed out, retried or not),
   requests refused for their size (by the client before sending, or by the server),
   skipped updates, the final prompt.

The model is built as a user builds it: the defaults (``timeout_s=60``, 4 attempts).

What the model's limits were (``await model.limits()``: from ``/props`` or
``/v1/models``) is printed first. The goal: both scripts complete with 0 timeouts and 0
context refusals. Run::

    python benchmarks/bench_real_server.py --url http://127.0.0.1:8080/v1 [--model NAME]
    python benchmarks/bench_real_server.py            # the local fake, figures not a model's
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import run_job
from asyncgraph.jobs.demo import build_demo_job
from asyncgraph.models import ModelCall, OpenAIChat, observe_calls
from asyncgraph.models._testing_local import LocalModelTestServer
from asyncgraph.optim import TGD, ReplySkippedWarning
from asyncgraph.text import TextLoss, llm_call, register_model, use_models

BENCH_MODEL = "bench-real-server"


@dataclass
class Calls:
    """What the model calls of one run did."""

    calls: list[ModelCall] = field(default_factory=list)

    def count(self, error: str) -> int:
        """Attempts that met ``error``: the calls it ended, and the retried attempts."""
        ended = sum(1 for c in self.calls if c.error and error in c.error)
        return ended + sum(c.retried_after.count(error) for c in self.calls)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.calls)


@contextlib.contextmanager
def recorded() -> Iterator[Calls]:
    calls = Calls()
    with observe_calls(calls.calls.append):
        yield calls


def make_model(url: str, name: str, *, max_concurrency: int | None = None) -> OpenAIChat:
    """The model as a user builds it: the defaults (``timeout_s=60``, 4 attempts), one
    slot or the server's."""
    return OpenAIChat(name, base_url=url, api_key="", max_concurrency=max_concurrency)


async def first_script(url: str, name: str, structured: bool) -> str:
    """The README's first script; the update's parse outcome."""
    model = make_model(url, name)
    with use_models(model), warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplySkippedWarning)
        prompt = Parameter("Answer the question.", role="system prompt")
        answer = await llm_call(prompt, Variable("What is 17 * 23?", role="question"))
        loss = await TextLoss("Is the answer correct? Be terse.")(answer)
        await loss.backward()
        tgd = TGD([prompt], structured=structured)
        await tgd.step()
    await model.aclose()
    if tgd.skipped:
        return f"skipped after {tgd.skipped[0].attempts} replies"
    return f"parsed: {prompt.data[:60]!r}"


async def demo(url: str, name: str, slots: int) -> dict[str, Any]:
    model = make_model(url, name, max_concurrency=slots)
    register_model(BENCH_MODEL, model)
    job, prompt = build_demo_job(BENCH_MODEL, epochs=1)
    started = time.perf_counter()
    with recorded() as calls, tempfile.TemporaryDirectory() as out:
        result = await run_job(job, out, progress=False)
    wall = time.perf_counter() - started
    limits = await model.limits()
    await model.aclose()
    return {
        "slots": slots,
        "server_slots": limits.max_concurrency,
        "wall_s": wall,
        "calls": len(calls.calls),
        "tokens_per_s": calls.completion_tokens / wall if wall else 0.0,
        "timeouts": calls.count("ModelTimeoutError"),
        "context_refusals": calls.count("ModelContextError"),
        # the longest call, queueing on the client and every attempt included (the
        # default timeout_s of 60 counts each attempt from its send)
        "longest_call_s": max((c.latency_s for c in calls.calls), default=0.0),
        "skipped_updates": result.skipped_updates,
        "steps": result.steps_done,
        "prompt": prompt.data,
    }


async def main(url: str | None, name: str | None, slot_counts: list[int]) -> None:
    with contextlib.ExitStack() as stack:
        if url is None:
            # 2 ms a generated token: enough for one slot and four to differ.
            server = stack.enter_context(
                LocalModelTestServer(slots=4, n_ctx=2048, s_per_token=0.002)
            )
            url, name = server.url, server.model
            print(f"server: LocalModelTestServer at {url} (a fake: figures are not a model's)")
        else:
            print(f"server: {url}")
        if name is None:
            name = "local-model"
        probe = make_model(url, name)
        limits = await probe.limits()
        await probe.aclose()
        print(
            f"model {name!r}: context window {limits.context_tokens} tokens "
            f"({limits.source or 'unknown'}), slots {limits.max_concurrency}"
        )
        print("\nthe README's first script, one TGD update:")
        for structured in (False, True):
            label = "structured outputs" if structured else "tags"
            try:
                outcome = await first_script(url, name, structured)
            except Exception as exc:  # shown, not raised: the other runs still tell
                outcome = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            print(f"  {label:>18}: {outcome}")
        print("\nthe demo job, one epoch:")
        print(
            f"  {'max_concurrency':>15} {'wall s':>8} {'calls':>6} {'tok/s':>7} "
            f"{'timeouts':>8} {'ctx refused':>11} {'skipped':>7}"
        )
        for slots in slot_counts:
            try:
                row = await demo(url, name, slots)
            except Exception as exc:
                print(f"  {slots:>15} failed: {type(exc).__name__}: {exc}")
                continue
            print(
                f"  {slots:>15} {row['wall_s']:>8.1f} {row['calls']:>6} "
                f"{row['tokens_per_s']:>7.1f} {row['timeouts']:>8} "
                f"{row['context_refusals']:>11} {row['skipped_updates']:>7}"
            )
            print(f"  {'':>15} longest call: {row['longest_call_s']:.1f} s")
            print(f"  {'':>15} final prompt: {row['prompt'][:100]!r}")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", help="the server's base URL (default: a local fake)")
    parser.add_argument("--model", help="the model name the server serves")
    parser.add_argument("--slots", default="1,4", help="max_concurrency values (default 1,4)")
    args = parser.parse_args()
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    anyio.run(main, args.url, args.model, slots)


if __name__ == "__main__":
    cli()
