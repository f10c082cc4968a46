"""Core engine benchmark: concurrency against the critical path, per-node overhead, memory.

Run: ``python benchmarks/bench_core.py [--backend asyncio|trio] [--latency-ms 200] [--nodes 100000]``

Prints, in one run:
1. backward wall time over the critical-path ideal for async nodes sleeping L:
   a fan-in of 64, a 16-wide 4-deep layered graph, two uneven chains (L then 3L,
   and 3L then L: a level-by-level scheduler needs 6L where 4L is possible);
2. per-node backward overhead (us) for a chain of no-op sync nodes and of no-op
   async nodes, next to torch.autograd.Function with ``return g`` when torch is
   installed (``pip install -e '.[bench]'``);
3. memory per node of the recorded graph (RSS delta after the forward) and the
   peak Python allocation during backward (tracemalloc).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from typing import Any

import anyio

from asyncgraph import Function, Parameter, Variable, backward


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


class Sleep(Function):
    """Identity whose backward sleeps ``ctx.delay_s`` (a stand-in for an LLM call)."""

    @staticmethod
    def forward(ctx: Any, *xs: Variable, delay_s: float) -> Any:
        ctx.delay_s = delay_s
        return sum(x.data for x in xs)

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Any, ...]:
        await anyio.sleep(ctx.delay_s)
        return (*(g if need else None for need in ctx.needs_input_grad[:-1]), None)


def sleep(*xs: Variable, delay_s: float) -> Variable:
    out: Variable = Sleep.apply(*xs, delay_s=delay_s)
    return out


async def timed_backward(root: Variable) -> float:
    start = time.perf_counter()
    await backward(root)
    return time.perf_counter() - start


async def concurrency(latency_s: float) -> list[tuple[str, float, float]]:
    rows = []
    L = latency_s

    x = Parameter(1.0)
    fan = [sleep(x, delay_s=L) for _ in range(64)]
    root = Nop.apply(sleep(*fan, delay_s=0.0))
    rows.append(("fan-in of 64", await timed_backward(root), L))

    x = Parameter(1.0)
    layer = [x]
    for _ in range(4):
        layer = [sleep(*layer, delay_s=L) for _ in range(16)]
    root = sleep(*layer, delay_s=0.0)
    rows.append(("16 wide x 4 deep", await timed_backward(root), 4 * L))

    x = Parameter(1.0)
    # backward runs from the root, so a chain whose first backward waits L is
    # the one built last: chain a = [L, 3L], chain b = [3L, L] in backward order.
    a = sleep(sleep(x, delay_s=3 * L), delay_s=L)
    b = sleep(sleep(x, delay_s=L), delay_s=3 * L)
    root = sleep(a, b, delay_s=0.0)
    rows.append(("uneven chains L,3L | 3L,L", await timed_backward(root), 4 * L))
    return rows


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def chain_overhead(fn: type[Function], n: int) -> tuple[float, float, float]:
    """Return (us per node backward, bytes per node RSS after forward, peak tracemalloc/node)."""
    gc.collect()
    before = rss_bytes()
    x = Parameter(1.0)
    h: Variable = x
    for _ in range(n):
        h = fn.apply(h)
    graph_bytes = (rss_bytes() - before) / n
    # Time the whole pass (planning included).
    start = time.perf_counter()
    await backward(h)
    per_node_us = (time.perf_counter() - start) / n * 1e6
    assert x.grad is not None and x.grad.data == 1.0
    del h
    gc.collect()
    # Peak Python memory of a second pass, measured separately (tracemalloc slows it).
    x = Parameter(1.0)
    h = x
    for _ in range(n):
        h = fn.apply(h)
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    await backward(h)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del h
    gc.collect()
    return per_node_us, graph_bytes, (peak - base) / n


async def wide_overhead(n: int) -> float:
    """us per node for n async no-op nodes side by side: every one needs its own task."""
    x = Parameter(1.0)
    outs = [AsyncNop.apply(x) for _ in range(n)]
    root = Sum.apply(*outs)
    start = time.perf_counter()
    await backward(root)
    elapsed = time.perf_counter() - start
    assert x.grad is not None and x.grad.data == float(n)
    return elapsed / n * 1e6


class Sum(Function):
    @staticmethod
    def forward(ctx: Any, *xs: Variable) -> Any:
        return float(len(xs))

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, ...]:
        return (g,) * len(ctx.needs_input_grad)


def torch_chain(n: int) -> tuple[float, float] | None:
    try:
        import torch
    except ImportError:
        return None

    class TNop(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    torch.set_num_threads(1)
    gc.collect()
    before = rss_bytes()
    x = torch.tensor(1.0, requires_grad=True)
    h = x
    for _ in range(n):
        h = TNop.apply(h)
    graph_bytes = (rss_bytes() - before) / n
    start = time.perf_counter()
    h.backward()
    per_node_us = (time.perf_counter() - start) / n * 1e6
    assert x.grad is not None and float(x.grad) == 1.0
    return per_node_us, graph_bytes


async def main(args: argparse.Namespace) -> None:
    latency_s = args.latency_ms / 1000
    print(f"asyncgraph core benchmark ({args.backend}), L = {args.latency_ms:.0f} ms")
    print("\n1. backward wall time over the critical-path ideal (goal <= 1.15x)")
    print(f"   {'graph':30s} {'wall':>8s} {'ideal':>8s} {'ratio':>7s}")
    for name, wall, ideal in await concurrency(latency_s):
        print(f"   {name:30s} {wall:7.3f}s {ideal:7.3f}s {wall / ideal:6.3f}x")

    n = args.nodes
    print(f"\n2./3. per-node overhead and memory, {n:,}-node chain of no-op nodes")
    print(f"   {'chain':28s} {'backward/node':>14s} {'graph RSS/node':>15s} {'bwd peak/node':>14s}")
    sync = await chain_overhead(Nop, n)
    print(
        f"   {'asyncgraph sync no-op':28s} {sync[0]:11.2f} us {sync[1]:12.0f} B {sync[2]:11.0f} B"
    )
    asy = await chain_overhead(AsyncNop, n)
    print(f"   {'asyncgraph async no-op':28s} {asy[0]:11.2f} us {asy[1]:12.0f} B {asy[2]:11.0f} B")
    wide = await wide_overhead(n)
    print(
        f"   {'asyncgraph async no-op, wide':28s} {wide:11.2f} us   (side by side: run by a pool of runner tasks)"
    )
    torch_row = torch_chain(n)
    if torch_row is None:
        print("   torch not installed: pip install -e '.[bench]' to compare")
    else:
        print(
            f"   {'torch.autograd.Function':28s} {torch_row[0]:11.2f} us {torch_row[1]:12.0f} B {'-':>14s}"
        )
        print(f"\n   sync no-op / torch per node: {sync[0] / torch_row[0]:.2f}x (goal <= 1.0x)")
        print(f"   graph memory / torch per node: {sync[1] / max(torch_row[1], 1):.2f}x")
    print(
        f"   async no-op per node: {asy[0]:.2f} us in a chain, {wide:.2f} us side by side (goal < 20 us)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--nodes", type=int, default=100_000)
    ns = parser.parse_args()
    anyio.run(main, ns, backend=ns.backend)
