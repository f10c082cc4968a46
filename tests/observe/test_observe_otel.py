"""OpenTelemetry: spans per pass, node and model call; one trace across real workers."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from asyncgraph import BackwardError, Function, Parameter, Variable, backward
from asyncgraph.models import SimulatedModel
from asyncgraph.observe.otel import otel_tracing
from asyncgraph.text import concat

HERE = Path(__file__).resolve().parent
MODEL = SimulatedModel(latency_s=0.02)


class Critique(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data, role="answer")

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> str:
        reply = await MODEL.complete([{"role": "user", "content": "critique this"}])
        return reply.text


class Latch:
    """Opens once ``count`` callers are waiting: tasks that pass it ran at the same time
    (run one after another, the first would wait for the deadline and fail)."""

    def __init__(self, count: int) -> None:
        self.count, self.waiting, self.open = count, 0, anyio.Event()

    async def wait(self) -> None:
        self.waiting += 1
        if self.waiting == self.count:
            self.open.set()
        with anyio.fail_after(120):
            await self.open.wait()


class CritiqueAtOnce(Function):
    """Critique, once every critique of the pass has started (``ctx.latch``)."""

    option_keywords = ("latch",)  # configures the call: not an input of the node

    @staticmethod
    def forward(ctx: Any, x: Variable, *, latch: Latch) -> Variable:
        ctx.latch = latch
        return Variable(x.data, role="answer")

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> str:
        await ctx.latch.wait()
        reply = await MODEL.complete([{"role": "user", "content": "critique this"}])
        return reply.text


class Broken(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> None:
        raise RuntimeError("no feedback today")


def provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer_provider, exporter


@pytest.mark.anyio
async def test_a_pass_its_nodes_and_their_model_calls_are_nested_spans() -> None:
    tracer_provider, exporter = provider()
    leaves = [Parameter(f"answer {i}", role="answer") for i in range(16)]
    latch = Latch(16)
    report = concat(*[CritiqueAtOnce.apply(p, latch=latch) for p in leaves])
    with otel_tracing(tracer_provider):
        await report.backward()
    spans = exporter.get_finished_spans()
    (pass_span,) = [s for s in spans if s.name == "asyncgraph.backward"]
    nodes = [s for s in spans if s.name == "CritiqueAtOnce.backward"]
    calls = [s for s in spans if s.name.startswith("chat ")]
    assert len(nodes) == 16 and len(calls) == 16
    assert {n.parent.span_id for n in nodes if n.parent} == {pass_span.context.span_id}
    node_ids = {n.context.span_id for n in nodes}
    assert {c.parent.span_id for c in calls if c.parent} == node_ids  # each in its node
    assert {s.context.trace_id for s in spans} == {pass_span.context.trace_id}
    assert nodes[0].attributes["asyncgraph.input_roles"] == ("answer",)
    call = calls[0].attributes
    assert call["gen_ai.operation.name"] == "chat"
    assert call["gen_ai.usage.input_tokens"] > 0 and call["gen_ai.usage.output_tokens"] > 0
    assert "gen_ai.prompt" not in call  # content only when asked for
    # The 16 critiques ran at once (each waited for all to start): every node span
    # overlaps every other, on a loaded machine too.
    assert max(n.start_time for n in nodes) < min(n.end_time for n in nodes)


@pytest.mark.anyio
async def test_sampled_passes_are_whole_and_the_others_record_nothing() -> None:
    """Head sampling per pass (a ParentBased ratio sampler): a sampled pass has all its
    node and model-call spans; an unsampled one, none (and costs a few microseconds)."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.5)))
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    passes = 24
    with otel_tracing(tracer_provider):
        for _ in range(passes):
            leaves = [Parameter(f"answer {i}", role="answer") for i in range(4)]
            await concat(*[Critique.apply(p) for p in leaves]).backward()
    spans = exporter.get_finished_spans()
    assert not any(s.attributes.get("asyncgraph.cancelled") for s in spans)
    recorded = {s.context.trace_id for s in spans if s.name == "asyncgraph.backward"}
    assert 0 < len(recorded) < passes  # some sampled, some not (p of failure ~ 1e-7)
    for trace_id in recorded:
        names = sorted(s.name for s in spans if s.context.trace_id == trace_id)
        assert names.count("Critique.backward") == 4 and names.count("chat simulated") == 4
    assert {s.context.trace_id for s in spans} == recorded  # nothing of the others


@pytest.mark.anyio
async def test_a_failed_node_is_an_error_span_and_content_is_captured_on_request() -> None:
    tracer_provider, exporter = provider()
    x = Parameter("x", role="x")
    with otel_tracing(tracer_provider, capture_content=True), pytest.raises(BackwardError):
        await Broken.apply(Critique.apply(x)).backward()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["Broken.backward"].status.status_code == StatusCode.ERROR
    assert "no feedback today" in (spans["Broken.backward"].status.description or "")
    assert spans["asyncgraph.backward"].status.status_code == StatusCode.ERROR
    tracer_provider2, exporter2 = provider()
    with otel_tracing(tracer_provider2, capture_content=True):
        await Critique.apply(Parameter("y", role="y")).backward()
    (call,) = [s for s in exporter2.get_finished_spans() if s.name.startswith("chat ")]
    assert "critique this" in call.attributes["gen_ai.prompt"]


@pytest.mark.anyio
async def test_nodes_cancelled_by_a_failure_end_as_cancelled_spans() -> None:
    """A node still running when another fails is cancelled: its span ends with the pass
    (an error, ``asyncgraph.cancelled``), not left open and never exported."""
    from .observe_helpers import Sleep, Total

    class LateBroken(Function):
        @staticmethod
        def forward(ctx: Any, x: Variable) -> Variable:
            return Variable(x.data)

        @staticmethod
        async def backward(ctx: Any, grad: Variable) -> None:
            await anyio.sleep(0.05)  # the other node has started by then
            raise RuntimeError("no feedback today")

    tracer_provider, exporter = provider()
    x = Variable(1.0, requires_grad=True)
    with otel_tracing(tracer_provider), pytest.raises(BackwardError):
        await Total.apply(LateBroken.apply(x), Sleep.apply(x, 5.0)).backward()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    sleep, broken = spans["Sleep.backward"], spans["LateBroken.backward"]
    assert sleep.attributes["asyncgraph.cancelled"] is True
    assert sleep.status.status_code == StatusCode.ERROR
    assert "asyncgraph.cancelled" not in broken.attributes
    assert broken.status.status_code == StatusCode.ERROR
    assert sleep.parent is not None
    assert sleep.parent.span_id == spans["asyncgraph.backward"].context.span_id
    assert sleep.end_time is not None and sleep.end_time <= spans["asyncgraph.backward"].end_time


class Receiver:
    """A real OTLP/HTTP receiver: decodes the protobuf ExportTraceServiceRequest it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[tuple[str, Any]] = []  # (service name, span)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    service = next(
                        (
                            a.value.string_value
                            for a in resource_spans.resource.attributes
                            if a.key == "service.name"
                        ),
                        "",
                    )
                    for scope in resource_spans.scope_spans:
                        receiver.spans += [(service, span) for span in scope.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        ).start()

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.spans) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


class Fleet:
    """Two real workers exporting their spans to ``receiver`` over OTLP/HTTP."""

    def __init__(self, redis_url: str, receiver: Receiver) -> None:
        from asyncgraph.distributed import wait_for_workers

        self.queue = f"otel-{uuid.uuid4().hex[:8]}"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "test-worker",
        }
        argv = [
            *(sys.executable, "-m", "asyncgraph", "worker", "--redis", redis_url),
            *("--queue", self.queue, "--import", "otel_functions", "--log-level", "WARNING"),
        ]
        self.workers = [subprocess.Popen(argv, env=env, cwd=HERE) for _ in range(2)]
        wait_for_workers(redis_url, self.queue, 2)

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()  # drains and exits: the batched spans are flushed at exit
        for worker in self.workers:
            worker.wait(30)


@pytest.fixture
def fleet(redis_url: str, receiver: Receiver) -> Iterator[Fleet]:
    started = Fleet(redis_url, receiver)
    yield started
    started.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_one_trace_shows_the_pass_across_two_real_workers(
    redis_url: str, receiver: Receiver, fleet: Fleet
) -> None:
    from asyncgraph.distributed import open_redis_executor

    from .otel_functions import Remote

    tracer_provider, exporter = provider()
    leaves = [Parameter(f"p{i}", role="prompt") for i in range(8)]
    with otel_tracing(tracer_provider):
        async with open_redis_executor(redis_url, queue=fleet.queue, timeout_s=30) as ex:
            await backward([Remote.apply(p) for p in leaves], ["fb"] * 8, executor=ex)
    assert all(p.grad is not None for p in leaves)
    await anyio.to_thread.run_sync(fleet.stop)
    await anyio.to_thread.run_sync(receiver.wait_for, 8)
    client = exporter.get_finished_spans()
    (pass_span,) = [s for s in client if s.name == "asyncgraph.backward"]
    node_ids = {s.context.span_id for s in client if s.name == "Remote.backward"}
    remote = [s for service, s in receiver.spans if s.name.startswith("asyncgraph.task")]
    assert len(remote) == 8, [s.name for _, s in receiver.spans]
    assert {service for service, _ in receiver.spans} == {"test-worker"}
    for span in remote:
        assert int.from_bytes(span.trace_id, "big") == pass_span.context.trace_id
        assert int.from_bytes(span.parent_span_id, "big") in node_ids
    attributes = {a.key: a.value for a in remote[0].attributes}
    assert attributes["asyncgraph.op"].string_value == "backward"
    assert attributes["asyncgraph.queue"].string_value == fleet.queue


class LeakyFailure(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> None:
        key = os.environ["OPENAI_API_KEY"]
        raise RuntimeError(f"redis://:otel-pass-123@h:1/0 refused key {key}")


@pytest.mark.anyio
async def test_spans_hold_the_host_alone_and_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncgraph.models import OpenAIChat
    from asyncgraph.models._testing import OpenAITestServer, Reply

    key = "sk-otel-key-0123456789"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    tracer_provider, exporter = provider()
    with OpenAITestServer() as server:
        host = server.url.split("//", 1)[1].split("/", 1)[0]
        url = server.url.replace("//", "//u:otel-url-pass@")
        server.script(Reply(text=f"echoing {key}"))
        model = OpenAIChat("test-model", base_url=url)

        class Call(Function):
            @staticmethod
            def forward(ctx: Any, x: Variable) -> Variable:
                return Variable(x.data)

            @staticmethod
            async def backward(ctx: Any, grad: Variable) -> str:
                return (await model.complete([{"role": "user", "content": key}])).text

        with otel_tracing(tracer_provider, capture_content=True):
            await Call.apply(Parameter("p", role="p")).backward()
            with pytest.raises(BackwardError):
                await LeakyFailure.apply(Parameter("q", role="q")).backward()
        await model.aclose()
    spans = exporter.get_finished_spans()
    (call,) = [s for s in spans if s.name.startswith("chat ")]
    assert call.attributes["server.address"] == host.rsplit(":", 1)[0]  # the host alone
    assert call.attributes["server.port"] == int(host.rsplit(":", 1)[1])
    assert call.attributes["gen_ai.prompt"] == '[{"role": "user", "content": "[redacted]"}]'
    texts = [
        str(
            (
                s.name,
                dict(s.attributes or {}),
                s.status.description,
                [(e.name, dict(e.attributes or {})) for e in s.events],
            )
        )
        for s in spans
    ]
    assert any("otel-pass" not in t and "[redacted]" in t for t in texts)
    for text in texts:
        for secret in (key, "otel-pass-123", "otel-url-pass"):
            assert secret not in text, (secret, text)
