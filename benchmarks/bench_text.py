"""Concurrency of the text functions and TGD against a simulated 100 ms model.

Prints, in one run, our wall time next to the sequential time (the sum of the
durations of every model call, i.e. what running them one after another
costs) and their ratio, for:

- one TGD step over 8 text parameters (8 model calls, all at once);
- one backward over a batch of 32 examples (answer = LLMCall(shared prompt,
  question); loss = TextLoss(answer); total = concat(losses)): 64 feedback
  calls, two levels deep. Goal: at least 10x faster than sequential.

    python benchmarks/bench_text.py [--backend asyncio|trio] [--latency-s 0.1]

Exits 1 if the batch backward misses its goal.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from asyncgraph import Parameter, Variable
from asyncgraph.models import Completion, SimulatedModel
from asyncgraph.models._types import Message
from asyncgraph.optim import TGD
from asyncgraph.text import TextLoss, concat, llm_call

GOAL = 10.0


class TimedModel:
    """A ChatModel that records how long each call to the wrapped model takes."""

    def __init__(self, model: SimulatedModel) -> None:
        self.model = model
        self.durations: list[float] = []

    async def complete(self, messages: Sequence[Message], **params: Any) -> Completion:
        start = time.perf_counter()
        completion = await self.model.complete(messages, **params)
        self.durations.append(time.perf_counter() - start)
        return completion

    def reset(self) -> None:
        self.durations.clear()


async def bench_tgd(model: TimedModel, n_params: int) -> tuple[int, float, float]:
    params = [
        Parameter(f"Instruction {i}: answer the question.", role=f"prompt {i}")
        for i in range(n_params)
    ]
    for p in params:
        p.grad = Variable(["The answer lacks units.", "The answer is too long."])
    tgd = TGD(params, model=model)
    model.reset()
    start = time.perf_counter()
    await tgd.step()
    wall = time.perf_counter() - start
    return len(model.durations), wall, sum(model.durations)


async def bench_batch_backward(model: TimedModel, batch: int) -> tuple[int, float, float]:
    prompt = Parameter("Answer the question in one sentence.", role="system prompt")
    loss_fn = TextLoss("Evaluate the answer for correctness and concision.", model=model)
    losses: list[Variable | None] = [None] * batch

    async def example(i: int) -> None:
        question = Variable(f"What is {i} + {i}?", role="question")
        answer = await llm_call(prompt, question, model=model, role="answer")
        losses[i] = await loss_fn(answer)

    async with anyio.create_task_group() as tg:  # the forward pass, not measured
        for i in range(batch):
            tg.start_soon(example, i)
    total = concat(*[loss for loss in losses if loss is not None])
    model.reset()
    start = time.perf_counter()
    await total.backward()
    wall = time.perf_counter() - start
    assert prompt.grad is not None and len(prompt.grad.data) == batch
    return len(model.durations), wall, sum(model.durations)


async def run(args: argparse.Namespace) -> bool:
    model = TimedModel(SimulatedModel(latency_s=args.latency_s))
    rows = [
        (f"TGD step, {args.params} parameters", *await bench_tgd(model, args.params), None),
        (
            f"backward, batch of {args.batch} examples",
            *await bench_batch_backward(model, args.batch),
            GOAL,
        ),
    ]
    print(
        f"asyncgraph text benchmark: SimulatedModel at {args.latency_s * 1000:.0f} ms per call, "
        f"backend {args.backend}"
    )
    print(f"{'':36} {'calls':>5} {'wall (s)':>9} {'sequential (s)':>15} {'speedup':>8}")
    ok = True
    for name, calls, wall, sequential, goal in rows:
        ratio = sequential / wall if wall > 0 else float("inf")
        line = f"{name:36} {calls:5d} {wall:9.3f} {sequential:15.3f} {ratio:7.1f}x"
        if goal is not None:
            met = ratio >= goal
            ok = ok and met
            line += f"   goal >= {goal:g}x: {'met' if met else 'MISSED'}"
        print(line)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--latency-s", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--params", type=int, default=8)
    args = parser.parse_args(argv)
    ok = anyio.run(run, args, backend=args.backend)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
