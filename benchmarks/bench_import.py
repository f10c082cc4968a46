"""How long ``import asyncgraph`` takes, in fresh processes (median of N), against anyio.

    python benchmarks/bench_import.py [--runs 21]

Prints the median wall time of ``python -c "import asyncgraph"`` and of ``import anyio``
(the floor: the core needs anyio), each minus a bare interpreter start, and which heavy
packages (httpx, redis, msgpack, numpy, rich) the import loaded (the goal: none).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HEAVY = ("httpx", "redis", "msgpack", "numpy", "rich")
# As installed code runs: with cached bytecode (a PYTHONDONTWRITEBYTECODE environment
# would recompile every module on every start, which is not what an import costs).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def median_start_s(code: str, runs: int) -> float:
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV)  # warm the caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    runs = parser.parse_args().runs
    bare = median_start_s("pass", runs)
    anyio_s = median_start_s("import anyio", runs) - bare
    ours = median_start_s("import asyncgraph", runs) - bare
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncgraph, sys; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(
        f"import anyio:      {anyio_s * 1000:6.1f} ms (median of {runs}, interpreter start removed)"
    )
    print(f"import asyncgraph: {ours * 1000:6.1f} ms (goal <= 40 ms)")
    print(f"heavy packages loaded by import asyncgraph: {loaded}")


if __name__ == "__main__":
    main()
