"""What seeing inside a pass costs: per-node backward time with tracing off and on.

Run: ``python benchmarks/bench_observe.py [--nodes 20000] [--rounds 7] [--backend asyncio]``

Graphs of no-op nodes (the worst case: the node does nothing, so the observers are all
there is): a chain of synchronous no-ops (run inline), a chain of async no-ops, and a
fan-in of async no-ops side by side. For each, the median over ``--rounds`` of the
backward time per node:

- ``off``: no observer (what every pass pays for the hooks: a contextvar read per pass
  and a contextvar set per node);
- ``on``: inside ``asyncgraph.observe.trace_pass()`` (a span per node, opened and
  closed by the engine's events), plus the cost of writing the trace JSON per node;
- ``otel``: inside ``asyncgraph.observe.otel.otel_tracing()`` with the OpenTelemetry
  SDK's tracer provider and a batch span processor (its exporter drops the spans), when
  ``asyncgraph[otel]`` is installed: a span per pass and per node;
- ``unsampled``: the same under a ``ParentBased`` sampler that drops the pass (what an
  unsampled pass costs under head sampling); the line after each graph gives the mean
  per node at a 1-in-100 sampling rate, computed from the two (0.99 x unsampled + 0.01 x
  recorded), not measured;
- and, last, what the SDK alone costs per span (``start_span`` + ``end``, bare and with a
  node span's attributes): the floor under the ``otel`` figure.

``--mode off`` runs only the first and imports nothing of ``asyncgraph.observe``, so
the same script measures a checkout without it (``PYTHONPATH=/path/to/main``): that is
the comparison with main. Figures in the README, not here.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio

from asyncgraph import Function, Variable, backward


class Nop(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


class AsyncNop(Function):
    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        return g


class Fan(Function):
    @staticmethod
    def forward(ctx: Any, *xs: Variable) -> Any:
        return 0.0

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, ...]:
        return tuple(g for _ in ctx.needs_input_grad)


def chain(fn: type[Function], n: int) -> Variable:
    y = Variable(1.0, requires_grad=True)
    for _ in range(n):
        y = fn.apply(y)
    return y


def fan_in(n: int) -> Variable:
    x = Variable(1.0, requires_grad=True)
    return Fan.apply(*[AsyncNop.apply(x) for _ in range(n)])  # type: ignore[no-any-return]


GRAPHS: dict[str, Callable[[int], Variable]] = {
    "chain of sync no-ops": lambda n: chain(Nop, n),
    "chain of async no-ops": lambda n: chain(AsyncNop, n),
    "fan-in of async no-ops": fan_in,
}


def otel_provider(sampled: bool = True) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON if sampled else ALWAYS_OFF))
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=1_000_000))
    return provider


async def per_node_us(build: Callable[[int], Variable], n: int, traced: bool | str) -> float:
    root = build(n)
    gc.collect()
    gc.disable()
    try:
        if traced in ("otel", "unsampled"):
            from asyncgraph.observe.otel import otel_tracing

            with otel_tracing(PROVIDER[0] if traced == "otel" else PROVIDER[1]):
                start = time.perf_counter()
                await backward(root)
                took = time.perf_counter() - start
        elif traced:
            from asyncgraph.observe import trace_pass

            with trace_pass() as timeline:
                start = time.perf_counter()
                await backward(root)
                took = time.perf_counter() - start
            del timeline
        else:
            start = time.perf_counter()
            await backward(root)
            took = time.perf_counter() - start
    finally:
        gc.enable()
    return took / n * 1e6


def write_us(n: int) -> float:
    """Recording plus writing the trace JSON, per node (a fan-in, traced)."""
    from asyncgraph.observe import trace_pass

    root = fan_in(n)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        start = time.perf_counter()
        with trace_pass(path):
            anyio.run(backward, root)
        return (time.perf_counter() - start) / n * 1e6


PROVIDER: list[Any] = []


def sdk_floor_us(n: int) -> tuple[float, float]:
    """What the OpenTelemetry SDK alone costs per span (the same sampled provider, under a
    parent span): a bare ``start_span`` + ``end``, and one with a node span's attributes."""
    tracer = PROVIDER[0].get_tracer("floor")
    attributes = {
        "asyncgraph.function": "AsyncNop",
        "asyncgraph.input_roles": ("",),
        "asyncgraph.output_roles": ("",),
        "asyncgraph.remote": False,
    }
    floors = []
    with tracer.start_as_current_span("pass"):
        for attrs in (None, attributes):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(n):
                    tracer.start_span("AsyncNop.backward", attributes=attrs).end()
                best = min(best, (time.perf_counter() - start) / n * 1e6)
            floors.append(best)
    return floors[0], floors[1]


async def main(args: argparse.Namespace) -> None:
    modes = ["off"] if args.mode == "off" else ["off", "on"]
    if args.mode == "both":
        try:
            PROVIDER.extend([otel_provider(), otel_provider(sampled=False)])
            modes.extend(["otel", "unsampled"])
        except ImportError:
            print("OpenTelemetry is not installed (asyncgraph[otel]): its row is skipped")
    print(f"{args.nodes:,} nodes per graph, median of {args.rounds} rounds, {args.backend}")
    for name, build in GRAPHS.items():
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:  # interleaved, so both see the same machine
                traced = mode if mode in ("otel", "unsampled") else mode == "on"
                results[mode].append(await per_node_us(build, args.nodes, traced))
        medians = {mode: statistics.median(values) for mode, values in results.items()}
        line = f"{name:26s} off {medians['off']:6.2f} us/node"
        for mode in ("on", "otel", "unsampled"):
            if mode in medians:
                line += (
                    f"   {mode} {medians[mode]:6.2f} us/node "
                    f"(+{medians[mode] - medians['off']:.2f})"
                )
        print(line, flush=True)
        if "unsampled" in medians:
            mean = 0.99 * medians["unsampled"] + 0.01 * medians["otel"] - medians["off"]
            print(f"{'':26s} otel sampling 1 pass in 100: +{mean:.2f} us/node (computed)")
    if "otel" in modes:
        bare, with_attributes = sdk_floor_us(args.nodes)
        print(
            f"OpenTelemetry SDK alone, per span: {bare:.2f} us bare, {with_attributes:.2f} us "
            f"with a node span's 4 attributes (the floor of a recorded node span)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--mode", default="both", choices=["off", "both"])
    arguments = parser.parse_args()
    anyio.run(main, arguments, backend=arguments.backend)
    if arguments.mode == "both":
        print(f"trace recorded and written (fan-in): {write_us(arguments.nodes):.2f} us/node")
