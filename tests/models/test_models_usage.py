"""Usage and cost totals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from asyncgraph.models import (
    MemoryCache,
    ModelRequestError,
    OpenAIChat,
    Pricing,
    SimulatedModel,
    Usage,
    UsageMeter,
)
from asyncgraph.models._testing import OpenAITestServer, Reply

pytestmark = pytest.mark.anyio


async def test_totals_count_tokens_requests_hits_errors_and_cost(
    server: OpenAITestServer,
) -> None:
    pricing = Pricing(input_usd_per_1m=2.0, output_usd_per_1m=10.0)
    model = OpenAIChat("m", base_url=server.url, api_key="k", pricing=pricing, cache=MemoryCache())
    async with model:
        # prompt 3 words; reply "echo: a b c" = 4 words
        await model.complete([{"role": "user", "content": "a b c"}])
        await model.complete([{"role": "user", "content": "a b c"}])  # cache hit: free
        await model.complete([{"role": "user", "content": "a b c d e"}], cache=False)
        server.script(Reply(status=400, error="bad"))
        with pytest.raises(ModelRequestError):
            await model.complete([{"role": "user", "content": "x"}], cache=False)
    usage = model.usage.snapshot()
    assert replace(usage, cost_usd=0.0) == Usage(
        requests=2, cache_hits=1, prompt_tokens=3 + 5, completion_tokens=4 + 6, errors=1
    )
    assert usage.cost_usd == pytest.approx((8 * 2.0 + 10 * 10.0) / 1e6)
    assert usage.total_tokens == 18


async def test_a_meter_can_total_several_models() -> None:
    meter = UsageMeter()
    a = SimulatedModel(latency_s=0, usage=meter)
    b = SimulatedModel(latency_s=0, usage=meter)
    await a.complete([{"role": "user", "content": "one"}])
    await b.complete([{"role": "user", "content": "two"}])
    assert meter.snapshot().requests == 2
    assert meter.reset().requests == 2
    assert meter.snapshot() == Usage()


def test_snapshot_is_immutable_and_defaults_to_zero_cost() -> None:
    usage = UsageMeter().snapshot()
    assert usage.cost_usd == 0.0
    with pytest.raises(AttributeError):
        usage.requests = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="prices"):
        Pricing(-1.0, 1.0)


@pytest.mark.anyio
async def test_track_usage_counts_every_model_in_the_block_and_its_tasks() -> None:
    import anyio

    from asyncgraph.models import SimulatedModel, track_usage

    a = SimulatedModel(latency_s=0.0, responder=lambda messages: "x")
    b = SimulatedModel(latency_s=0.0, responder=lambda messages: "y")
    message = [{"role": "user", "content": "hi"}]
    await a.complete(message)  # before the block: not counted
    with track_usage() as outer:
        await a.complete(message)
        with track_usage() as inner:
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.complete, message)
                tg.start_soon(b.complete, message)
    assert inner.snapshot().requests == 2
    assert outer.snapshot().requests == 3
    assert a.usage.snapshot().requests == 2  # each model still keeps its own totals
    assert b.usage.snapshot().requests == 2
