"""Two source trees of asyncgraph side by side: a remote no-op node's round trip, the
throughput and CPU of 5,000, or a wide pass of 256 remote 200 ms nodes, paired block by block.

    python benchmarks/compare_trees.py TREE_A TREE_B [--mode round-trip|throughput|wide] [--blocks 12]

A TREE is a checkout (``git worktree add /tmp/base HEAD~3``). Each tree gets its own
redis-server, worker process and client process, all started first and kept alive;
then the client of each is driven in turn, block after block (A B, B A, A B, ...), so
that both trees meet the same moments of a shared, noisy machine. Prints each block's
figure and the median for each tree: the round trip's median in microseconds, or
tasks per second and the CPU per task of worker + redis-server + client, or (``wide``, on
2 workers x 128 as ``bench_distributed.py``'s) the wall of 256 remote nodes sleeping
200 ms over the critical path (the best of ``WIDE_PASSES``) and its CPU per node. Both trees run
signed (a secret in ``ASYNCGRAPH_SECRET``, as ``bench_distributed.py`` does), unless
``--unsigned``.

Why: on a small virtual machine one run of ``bench_distributed.py`` against the next
moves by 20% or more with no change of code, which hides a change of 10%; blocks
interleaved within one sitting do not. It compares trees, not systems: the goals are
stated against ``bench_distributed.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
PASSES = 300  # round trips per block
TASKS = 5000  # nodes per throughput block
WIDE_PASSES = 3  # wide passes per block (its figure: the best)
SECRET = "a benchmark's shared secret, 32+ bytes long"


def child(tree: str, mode: str, unsigned: bool) -> None:
    """Serve blocks of ``mode`` for ``tree``: one line on stdin asks for a block, one
    line on stdout answers it; an empty line ends."""
    sys.path[:0] = [tree, f"{tree}/benchmarks"]
    os.environ["PYTHONPATH"] = tree  # the worker runs this tree's code too
    os.environ["ASYNCGRAPH_SECRET"] = "" if unsigned else SECRET  # the worker's and the client's
    import bench_distributed as bench
    import dist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import RedisServer, open_redis_executor

    with RedisServer() as server:
        assert server._proc is not None
        redis_pid = server._proc.pid
        count, concurrency = (2, 128) if mode == "wide" else (1, 256)
        workers = bench.asyncgraph_workers(server.url, count, concurrency)
        with bench.processes(workers, bench.workers_alive(server.url, count)) as procs:
            pids = [*(w.pid for w in procs), redis_pid]

            async def serve() -> None:
                async with open_redis_executor(server.url, queue=bench.QUEUE, timeout_s=120) as ex:
                    for _ in range(100):  # warm up
                        await backward(F.Noop.apply(Parameter(1.0)), executor=ex)
                    print("ready", flush=True)
                    while (await anyio.to_thread.run_sync(sys.stdin.readline)).strip():
                        if mode == "round-trip":
                            times = await bench.graph_latency(ex, PASSES)
                            print(statistics.median(times) * 1e6, flush=True)
                        elif mode == "wide":
                            before = bench.cpu_of(pids)
                            ratios = [await bench.sleepers(ex) for _ in range(WIDE_PASSES)]
                            cpu = (bench.cpu_of(pids) - before) / (256 * WIDE_PASSES) * 1e6
                            print(min(ratios) * 1000, cpu, flush=True)
                        else:
                            before = bench.cpu_of(pids)
                            rate = await bench.graph_throughput(ex, TASKS, rounds=1)
                            cpu = (bench.cpu_of(pids) - before) / TASKS * 1e6
                            print(rate, cpu, flush=True)

            anyio.run(serve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs=2, metavar="TREE")
    parser.add_argument(
        "--mode", choices=("round-trip", "throughput", "wide"), default="round-trip"
    )
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--unsigned", action="store_true", help="run both trees without a secret")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mode, args.unsigned)
        return
    trees = [str(Path(t).resolve()) for t in args.trees]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *trees,
                "--mode",
                args.mode,
                *(["--unsigned"] if args.unsigned else []),
                "--child",
                tree,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tree in trees
    ]
    try:
        for proc in procs:
            assert proc.stdin is not None and proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"a child did not start: {proc.args!r}")
        blocks: list[list[list[float]]] = [[], []]
        for block in range(args.blocks):
            for i in (0, 1) if block % 2 == 0 else (1, 0):
                stdin, stdout = procs[i].stdin, procs[i].stdout
                assert stdin is not None and stdout is not None
                stdin.write("go\n")
                stdin.flush()
                blocks[i].append([float(x) for x in stdout.readline().split()])
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.write("\n")
                proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=60)
    names = {
        "round-trip": ("round trip, us (median of each block)",),
        "throughput": ("tasks/s", "CPU per task, us (worker + redis-server + client)"),
        "wide": (
            "256 x 200 ms, wall / critical path x 1000 (best of each block)",
            "CPU per node, us (workers + redis-server + client)",
        ),
    }[args.mode]
    for k, name in enumerate(names):
        print(name)
        for tree, rows in zip(trees, blocks, strict=True):
            values = [row[k] for row in rows]
            shown = " ".join(f"{v:.0f}" for v in values)
            print(f"  {tree}: median {statistics.median(values):.0f}   blocks: {shown}")


if __name__ == "__main__":
    main()
