"""Start-up: ``import asyncgraph``, ``import asyncgraph.text`` and every ``asyncgraph SUB
--help``, each against its baseline in the same run (fresh processes, median of N).

    python benchmarks/bench_import.py [--runs 21]

Goals (#35): ``import asyncgraph`` <= 1.0x ``import asyncio``; ``import asyncgraph.text``
(offline use) <= 2x ``import asyncio``; every ``asyncgraph SUB --help`` <= 1.0x
``python -m pip --help``. Import times have a bare interpreter's start removed; command
times are whole processes, as a user waits for them. Also prints which heavy packages
(httpx, redis, msgpack, numpy, rich) each import loaded (the goal: none). Runs are
interleaved (one of each per round), so a change of the machine's load touches all alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from asyncgraph.cli import SUBCOMMANDS  # every subcommand the command has (imports none)

HEAVY = ("httpx", "redis", "msgpack", "numpy", "rich")
# As installed code runs: with cached bytecode (a PYTHONDONTWRITEBYTECODE environment
# would recompile every module on every start, which is not what an import costs).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _commands() -> dict[str, list[str]]:
    py = sys.executable
    found = {
        "bare": [py, "-c", "pass"],
        "import asyncio": [py, "-c", "import asyncio"],
        "import asyncgraph": [py, "-c", "import asyncgraph"],
        "import asyncgraph.text": [py, "-c", "import asyncgraph.text"],
        "pip --help": [py, "-m", "pip", "--help"],
        "asyncgraph --help": [py, "-m", "asyncgraph", "--help"],
    }
    for sub in SUBCOMMANDS:
        found[f"asyncgraph {sub} --help"] = [py, "-m", "asyncgraph", sub, "--help"]
    return found


def measure(runs: int) -> dict[str, float]:
    commands = _commands()
    for argv in commands.values():  # warm the caches
        subprocess.run(argv, check=True, env=ENV, capture_output=True)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, env=ENV, capture_output=True)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in times.items()}


def heavy_loaded(module: str) -> str:
    code = (
        f"import {module}, sys; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=ENV
    )
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    runs = parser.parse_args().runs
    load = os.getloadavg()[0]
    t = measure(runs)
    bare = t["bare"]
    asyncio_s = t["import asyncio"] - bare
    print(f"median of {runs} fresh processes; load {load:.2f} at the start")
    for name, goal in (("import asyncgraph", 1.0), ("import asyncgraph.text", 2.0)):
        ours = t[name] - bare
        ratio = ours / asyncio_s
        verdict = "met" if ratio <= goal else "NOT met"
        print(
            f"{name:24s} {ours * 1000:6.1f} ms = {ratio:4.2f}x import asyncio "
            f"({asyncio_s * 1000:.1f} ms); goal <= {goal:.1f}x: {verdict}; heavy loaded: "
            f"{heavy_loaded(name.split()[1])}"
        )
    pip = t["pip --help"]
    print(f"{'pip --help':24s} {pip * 1000:6.1f} ms (whole process)")
    for sub in ("", *SUBCOMMANDS):
        name = f"asyncgraph {sub} --help".replace("  ", " ")
        ratio = t[name] / pip
        verdict = "met" if ratio <= 1.0 else "NOT met"
        print(f"{name:24s} {t[name] * 1000:6.1f} ms = {ratio:4.2f}x pip --help: {verdict}")


if __name__ == "__main__":
    main()
