"""Usage and cost totals."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace
from typing import Any

import anyio
import pytest

from asyncgraph.models import (
    Completion,
    MemoryCache,
    ModelConnectionError,
    ModelError,
    ModelRequestError,
    ModelServerError,
    ModelTimeoutError,
    OpenAIChat,
    Pricing,
    Retry,
    SimulatedModel,
    Usage,
    UsageMeter,
    track_usage,
)
from asyncgraph.models import _base as base
from asyncgraph.models._testing import OpenAITestServer, Reply

pytestmark = pytest.mark.anyio


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def test_each_record_adds_its_one_event_and_add_sees_whole_reports_only() -> None:
    class Watched(UsageMeter):  # as a job's cost cap watches a meter
        def __init__(self) -> None:
            super().__init__()
            self.reports: list[Usage] = []

        def add(self, usage: Usage) -> None:
            super().add(usage)
            self.reports.append(usage)

    pricing = Pricing(input_usd_per_1m=2.0, output_usd_per_1m=10.0, cached_input_usd_per_1m=1.0)
    answer = Completion(
        "hi", model="m", prompt_tokens=100, completion_tokens=10, cache_read_tokens=40
    )
    meter = Watched()
    meter.record_completion(answer, pricing)
    meter.record_replay(answer, None)
    meter.record_cut(50, 20, pricing)
    meter.record_cache_hit()
    meter.record_retry()
    meter.record_error()
    assert meter.reports == []
    expected = Usage(
        requests=2,
        cache_hits=1,
        prompt_tokens=100 + 100 + 50,
        completion_tokens=10 + 10 + 20,
        cost_usd=(60 * 2.0 + 40 * 1.0 + 10 * 10.0) / 1e6 + (50 * 2.0 + 20 * 10.0) / 1e6,
        retries=1,
        errors=1,
        unpriced_requests=1,
        cache_read_tokens=80,
        replayed=1,
        cut=1,
    )
    assert replace(meter.snapshot(), cost_usd=0.0) == replace(expected, cost_usd=0.0)
    assert meter.snapshot().cost_usd == pytest.approx(expected.cost_usd)
    meter.add(Usage(requests=3))  # a worker's report
    assert meter.reports == [Usage(requests=3)] and meter.snapshot().requests == 5


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


# -- NOTE [One meter]: every call sent is counted, answered or cut ---------------------------


class Gate:
    """A server-side hold: requests whose last message contains ``"hold"`` wait (in the
    server's thread) until ``release()``, then are answered and billed."""

    def __init__(self, server: OpenAITestServer) -> None:
        self.open = threading.Event()
        self.held = 0  # requests that reached the hold
        server.handler = self.answer

    def answer(self, body: Any) -> Reply | None:
        if "hold" in str(body["messages"][-1]["content"]):
            self.held += 1
            self.open.wait(30)
        return None

    def release(self) -> None:
        self.open.set()


async def until(check: Any, timeout_s: float = 20.0) -> None:
    """Wait (polling; what it waits for happens in another thread) until ``check()``."""
    with anyio.fail_after(timeout_s):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_call_cut_while_the_server_works_is_counted_at_an_upper_bound(
    server: OpenAITestServer,
) -> None:
    pricing = Pricing(0.15, 0.60)
    gate = Gate(server)
    model = OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="k", pricing=pricing)
    messages = [{"role": "user", "content": "please hold the line for a while"}]
    try:
        with track_usage() as tracked:
            async with model, anyio.create_task_group() as tg:
                tg.start_soon(lambda: model.complete(messages, max_tokens=50))
                await until(lambda: gate.held == 1)
                assert model.usage.in_flight == tracked.in_flight == 1
                tg.cancel_scope.cancel()
    finally:
        gate.release()
    assert server.wait_for_bill(1)  # the server finished it, and billed it
    usage = model.usage.snapshot()
    prompt = model.cut_bound(messages, {"max_tokens": 50})[0]  # the request's bytes
    assert prompt >= model.estimate_prompt_tokens(messages)
    assert usage == tracked.snapshot()
    assert replace(usage, cost_usd=0.0) == Usage(cut=1, prompt_tokens=prompt, completion_tokens=50)
    assert usage.cost_usd == pytest.approx(pricing.cost_usd(prompt, 50))
    assert usage.upper_bound and usage.cost_text.startswith("at most $")
    assert usage.cost_usd >= server.billed_usd(pricing) > 0  # an upper bound of the bill
    assert model.usage.in_flight == 0


async def test_the_answer_share_of_the_bound_is_what_the_request_allows(
    server: OpenAITestServer,
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="k")
    assert plain.cut_bound(messages, {})[1] == plain.max_answer_tokens == 16_384
    assert plain.cut_bound(messages, {"max_completion_tokens": 7})[1] == 7
    capped = OpenAIChat(
        "gpt-4o-mini", base_url=server.url, api_key="k", default_params={"max_tokens": 99}
    )
    assert capped.cut_bound(messages, {})[1] == 99
    assert capped.cut_bound(messages, {"max_tokens": 5})[1] == 5


async def test_the_prompt_share_of_the_bound_is_never_below_what_a_server_counts(
    server: OpenAITestServer,
) -> None:
    """CJK text (about a token a character where the estimate says a quarter) and tool
    schemas (sent in params, not in the messages) are inside the bound: a byte-level BPE
    token is at least one byte, and the bound counts the request's bytes."""
    model = OpenAIChat("gpt-4o-mini", base_url=server.url, api_key="k")
    cjk = [{"role": "user", "content": "漢字" * 200}]
    assert model.cut_bound(cjk, {})[0] >= 400 > model.estimate_prompt_tokens(cjk)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "y" * 800}}}]
    short = [{"role": "user", "content": "hi"}]
    assert model.cut_bound(short, {"tools": tools})[0] >= 800


async def test_a_timeout_is_counted_at_an_upper_bound_a_refusal_and_a_closed_port_are_not(
    server: OpenAITestServer,
) -> None:
    pricing = Pricing(1.0, 2.0)
    gate = Gate(server)
    timing_out = OpenAIChat(
        "m", base_url=server.url, api_key="k", pricing=pricing, timeout_s=0.3, retry=Retry(1)
    )
    messages = [{"role": "user", "content": "hold"}]
    try:
        async with timing_out:
            with pytest.raises(ModelTimeoutError):
                await timing_out.complete(messages, max_tokens=20)
    finally:
        gate.release()
    assert timing_out.usage.snapshot().cut == 1
    assert timing_out.usage.snapshot().completion_tokens == 20
    refused = OpenAIChat("m", base_url=server.url, api_key="k", pricing=pricing, retry=Retry(1))
    server.script(Reply(status=500))
    async with refused:
        with pytest.raises(ModelServerError):
            await refused.complete([{"role": "user", "content": "x"}])
    assert refused.usage.snapshot() == Usage(errors=1)
    nowhere = OpenAIChat(
        "m", base_url=f"http://127.0.0.1:{free_port()}/v1", pricing=pricing, retry=Retry(1)
    )
    async with nowhere:
        with pytest.raises(ModelConnectionError):
            await nowhere.complete([{"role": "user", "content": "x"}])
    assert nowhere.usage.snapshot() == Usage(errors=1)


async def test_stop_sending_holds_new_calls_and_lets_the_calls_in_flight_finish(
    server: OpenAITestServer,
) -> None:
    pricing = Pricing(1.0, 2.0)
    gate = Gate(server)
    model = OpenAIChat("m", base_url=server.url, api_key="k", pricing=pricing)
    answered: list[Any] = []
    try:
        with track_usage() as meter:
            async with model, anyio.create_task_group() as tg:

                async def ask(text: str) -> None:
                    answered.append(await model.complete([{"role": "user", "content": text}]))

                tg.start_soon(ask, "hold one")
                await until(lambda: meter.in_flight == 1)
                meter.stop_sending("the budget is spent")
                tg.start_soon(ask, "two")  # held at its send: never reaches the server
                await anyio.wait_all_tasks_blocked()
                gate.release()
                await until(lambda: meter.in_flight == 0)
                assert [a.text for a in answered] == ["echo: hold one"]
                tg.cancel_scope.cancel()  # what a job does once nothing is in flight
    finally:
        gate.release()
    assert len(server.requests) == 1 and len(server.bill) == 1
    usage = meter.snapshot()
    assert usage.requests == 1 and usage.cut == 0 and not usage.upper_bound
    assert usage.cost_usd == pytest.approx(server.billed_usd(pricing), rel=1e-12)


async def test_a_call_held_by_stop_sending_is_not_sent_and_raises_after_the_hold(
    server: OpenAITestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "SEND_HOLD_S", 0.05)  # nothing cancels it here
    model = OpenAIChat("m", base_url=server.url, api_key="k")
    with track_usage() as meter:
        meter.stop_sending("the budget is spent")
        async with model:
            with pytest.raises(ModelError, match="not sent: the budget is spent"):
                await model.complete([{"role": "user", "content": "x"}])
    assert server.requests == [] and meter.snapshot() == Usage(errors=1)
