"""What the workers of ``test_jobs_fleet_spending`` import (``jobs.spending_functions``:
``tests/`` on their ``PYTHONPATH``), and the test process too, so both sides have them.

- ``PRICED_MODEL``: the demo's scripted replies on a priced simulated model. Every call
  it answers, in any process, appends ``PID COST_USD`` to the file named by
  ``$SPENDING_CALLS`` (if set): what was paid, counted outside the job's own meter.
- ``AskedSquaredError``: the line-fit loss ``(w * x - y) ** 2`` whose remote backward
  asks a model (an OpenAI-compatible server) for a scale, and can be held after that
  call, before its reply, for a test to SIGKILL the worker there.
- ``PricedAsk``: the same loss, whose remote backward asks at gpt-4o-mini's prices (for
  ``test_jobs_bill``: what the job reports against what the server billed), and waits,
  cancellably, after an answer that says ``WAIT``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Literal

import anyio

from asyncgraph import Function, Variable
from asyncgraph.jobs.demo import demo_responder
from asyncgraph.models import Completion, OpenAIChat, Pricing, SimulatedModel
from asyncgraph.models._prices import PRICES
from asyncgraph.text import register_model

PRICED_MODEL = "priced-fleet"
CALLS_ENV = "SPENDING_CALLS"
HOLD_S = 30.0  # a held backward gives up holding after this long


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


class RecordedModel(SimulatedModel):
    """A ``SimulatedModel`` that appends ``PID COST_USD`` per answer to ``$SPENDING_CALLS``."""

    async def _complete_once(self, messages: list[dict[str, Any]], params: dict[str, Any]) -> Any:
        completion: Completion = await super()._complete_once(messages, params)
        path = os.environ.get(CALLS_ENV)
        if path and self.pricing is not None:
            cost = self.pricing.completion_cost_usd(completion)
            _append(path, f"{os.getpid()} {cost!r}\n")
        return completion


register_model(
    PRICED_MODEL,
    RecordedModel(
        latency_s=0.001, responder=demo_responder, tag_replies=False, pricing=Pricing(15.0, 60.0)
    ),
)


def read_calls(path: Any) -> list[tuple[int, float]]:
    """The ``(pid, cost_usd)`` of every call ``RecordedModel`` answered, in any process."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [(int(pid), float(cost)) for pid, cost in (line.split() for line in lines)]


def _hold(redis_url: str, tag: str) -> None:
    """The first backward to get here while ``<tag>:hold`` exists pushes its pid on
    ``<tag>:called`` and waits for the key to go (or ``HOLD_S``); every other one, and
    any once the key is gone, goes on at once."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        if not client.exists(f"{tag}:hold") or not client.set(f"{tag}:claimed", 1, nx=True):
            return
        client.rpush(f"{tag}:called", os.getpid())
        deadline = time.monotonic() + HOLD_S
        while client.exists(f"{tag}:hold") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        client.close()


class AskedSquaredError(Function):
    """``(w * x - y) ** 2`` for a Parameter ``w`` and numbers ``x``, ``y``; the backward
    (remote) asks the model at ``base_url`` ``"scale for w=.. x=.. y=.."`` and multiplies
    the exact gradient by the number its answer ends with. ``hold``: ``(redis_url, tag)``
    for ``_hold`` after that call, or None."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    def forward(ctx: Any, w: Variable, x: float, y: float, base_url: str, hold: Any) -> Variable:
        ctx.w, ctx.x, ctx.y = w.data, x, y
        ctx.residual = w.data * x - y
        ctx.base_url, ctx.hold = base_url, hold
        return Variable(ctx.residual**2, role="squared error")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Any, None, None, None, None]:
        question = f"scale for w={ctx.w!r} x={ctx.x!r} y={ctx.y!r}"
        async with OpenAIChat(
            "gpt-test", ctx.base_url, "sk-test", pricing=Pricing(1.0, 2.0)
        ) as model:
            reply = await model.complete([{"role": "user", "content": question}])
        scale = float(reply.text.split()[-1])
        if ctx.hold is not None:
            await anyio.to_thread.run_sync(_hold, *ctx.hold)
        return (2 * ctx.residual * ctx.x * g.data * scale, None, None, None, None)


ASK_PRICE = PRICES["gpt-4o-mini"]  # the project's table: OpenAI's published prices
ASK_MAX_TOKENS = 40  # each answer at most: the answer's share of a cut call's bound
WAIT = "wait"  # an answer that makes the asking backward wait (cancellably) before it returns


class PricedAsk(Function):
    """``(w * x - y) ** 2`` for a Parameter ``w`` and numbers ``x``, ``y``; the backward
    (remote) asks the model at ``base_url`` (gpt-4o-mini at the table's prices, at most
    ``ASK_MAX_TOKENS`` of answer) ``"scale for w=.. x=.. y=.."`` in five words, and when
    the answer is ``WAIT`` it waits ``HOLD_S`` before it returns the exact gradient (a
    cancel stops it there, its call answered and paid)."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"

    @staticmethod
    def forward(ctx: Any, w: Variable, x: float, y: float, base_url: str) -> Variable:
        ctx.w, ctx.x, ctx.y, ctx.base_url = w.data, x, y, base_url
        ctx.residual = w.data * x - y
        return Variable(ctx.residual**2, role="squared error")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Any, None, None, None]:
        question = f"scale for w={ctx.w!r} x={ctx.x!r} y={ctx.y!r}"
        async with OpenAIChat("gpt-4o-mini", ctx.base_url, "sk-test", pricing=ASK_PRICE) as model:
            reply = await model.complete(
                [{"role": "user", "content": question}], max_tokens=ASK_MAX_TOKENS
            )
        if reply.text == WAIT:
            await anyio.sleep(HOLD_S)
        return (2 * ctx.residual * ctx.x * g.data, None, None, None)
