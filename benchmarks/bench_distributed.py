"""Distributed backward: asyncgraph's Redis executor against the local executor, two
hand-written redis-py streams baselines, arq and saq, all in one run on one throwaway
redis-server.

    python benchmarks/bench_distributed.py [--quick] [--no-others] [--unsigned]

Prints, for each system: round trip of one no-op remote node (median, p99), throughput
of 5,000 no-op nodes with 1 and 2 worker processes, CPU seconds per task (client +
workers + redis-server, from /proc, over the throughput runs), and for asyncgraph the
wall time of 256 remote nodes sleeping 200 ms on 2 workers x 128 concurrency over the
critical-path ideal (200 ms), next to the local executor's and the same-guarantee
client's (256 tasks that sleep 200 ms on 2 of its workers x 128) in the same run. Then the
ratios the goals are stated in. arq and saq are optional (``pip install arq saq``);
they are skipped when missing. The machine's load (``/proc/loadavg``) is printed at the
start and the end.

The goals are stated against the *same-guarantee* baseline (``dist_raw.py --guarded``):
a redis-py client and worker that check an HMAC-SHA256 of every task and reply and
claim each task (``SET NX PX``, pipelined per batch) before it runs, as asyncgraph's
signed fleet does (its replay memory: NOTE [Replays] in ``worker._admission``).
asyncgraph runs signed here (``ASYNCGRAPH_SECRET``; ``--unsigned`` runs it without a
secret, for a comparison with earlier runs). The *plain* baseline, which checks nothing,
is printed as the floor.

The raw baseline is redis-py *with hiredis*, as its users run it (``redis[hiredis]``;
``pip install -e ".[bench-redis]"``): the run refuses to start without hiredis unless
``--allow-no-hiredis`` is given, and says which parser the baseline used.

asyncgraph's no-op node has an async backward (it runs on the worker's event loop); a
worker runs every synchronous backward in a thread, so a synchronous no-op (measured on
its own row, asyncio client) adds a thread hop on the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dist_functions as F  # noqa: E402

from asyncgraph import LocalExecutor, Parameter, backward  # noqa: E402
from asyncgraph.distributed import open_redis_executor  # noqa: E402
from asyncgraph.distributed._redis_server import RedisServer  # noqa: E402

QUEUE = "bench"
SECRET = "a benchmark's shared secret, 32+ bytes long"


@contextlib.contextmanager
def processes(
    argvs: list[list[str]], ready: Callable[[], bool] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    procs = [
        subprocess.Popen(
            argv,
            env=env,
            cwd=HERE,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for argv in argvs
    ]
    try:
        deadline = time.monotonic() + 20
        while ready is not None and not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"workers did not start: {argvs[0]}")
            time.sleep(0.05)
        if ready is None:
            time.sleep(1.5)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def asyncgraph_workers(url: str, count: int, concurrency: int) -> list[list[str]]:
    return [
        [
            sys.executable,
            "-m",
            "asyncgraph",
            "worker",
            "--redis",
            url,
            "--queue",
            QUEUE,
            "--import",
            "dist_functions",
            "--concurrency",
            str(concurrency),
            "--log-level",
            "WARNING",
        ]
        for _ in range(count)
    ]


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) spent so far by ``pids`` and by this process."""
    total = sum(os.times()[:2])
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def with_cpu(pids: list[int], run: Callable[[], float], tasks: int) -> tuple[float, float]:
    """``run()``'s result and the CPU seconds per task that ``pids`` + this process spent."""
    before = cpu_of(pids)
    result = run()
    return result, (cpu_of(pids) - before) / tasks


def workers_alive(url: str, count: int) -> Callable[[], bool]:
    client = redis.Redis.from_url(url)
    return lambda: int(client.hlen(f"asyncgraph:{{{QUEUE}}}:workers")) >= count


def stats(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    return statistics.median(ordered) * 1e3, ordered[
        min(len(ordered) - 1, int(len(ordered) * 0.99))
    ] * 1e3


async def graph_latency(executor: Any, n: int, fn: Any = F.Noop) -> list[float]:
    times = []
    for i in range(n + 20):
        y = fn.apply(Parameter(1.0))
        started = time.perf_counter()
        await backward(y, executor=executor)
        if i >= 20:
            times.append(time.perf_counter() - started)
    return times


async def graph_throughput(executor: Any, n: int, rounds: int = 3, fn: Any = F.Noop) -> float:
    best = 0.0
    for _ in range(rounds):
        leaves = [Parameter(1.0) for _ in range(n)]
        outs = [fn.apply(p) for p in leaves]
        started = time.perf_counter()
        await backward(outs, executor=executor)
        best = max(best, n / (time.perf_counter() - started))
    return best


async def sleepers(executor: Any, n: int = 256, seconds: float = 0.2) -> float:
    """The wide pass: its wall time over ``seconds`` (the critical path)."""
    return (await wide_pass(executor, n, seconds))[0]


async def wide_pass(executor: Any, n: int = 256, seconds: float = 0.2) -> tuple[float, float]:
    """``n`` nodes sleeping ``seconds`` in one backward: the wall time over ``seconds``,
    and this process's CPU seconds a node (``time.process_time()``)."""
    leaves = [Parameter(1.0) for _ in range(n)]
    outs = [F.Sleep.apply(p, seconds) for p in leaves]
    started, cpu = time.perf_counter(), time.process_time()
    await backward(outs, executor=executor)
    return (time.perf_counter() - started) / seconds, (time.process_time() - cpu) / n


def run_remote(url: str, body: Callable[[Any], Awaitable[Any]], backend: str = "asyncio") -> Any:
    async def main() -> Any:
        async with open_redis_executor(url, queue=QUEUE, timeout_s=120) as ex:
            return await body(ex)

    return anyio.run(main, backend=backend)


def other(script: str, url: str, latency_n: int, tasks: int) -> tuple[list[float], float]:
    """Measure a compared system in a subprocess, killed if it hangs."""
    result = subprocess.run(
        [sys.executable, script, "measure", url, str(latency_n), str(tasks)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    *times, rate = map(float, result.stdout.split())
    return times, rate


def loadavg() -> str:
    """The machine's load average over 1, 5 and 15 minutes."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(
    rows: list[tuple[str, str, str, str, str]], figures: dict[str, float], local_ratio: float
) -> None:
    print()
    print(f"{'system':40} {'rt med ms':>9} {'rt p99 ms':>9} {'1 worker/s':>10} {'2 workers/s':>11}")
    for r in rows:
        print(f"{r[0]:40} {r[1]:>9} {r[2]:>9} {r[3]:>10} {r[4]:>11}")
    print()
    ratio = figures["critical_path_ratio"]
    guarded = figures["guarded_critical_path_ratio"]
    print(
        f"256 remote nodes x 200 ms, 2 workers x 128: wall / critical-path ideal = "
        f"{ratio:.3f}; local executor {local_ratio:.3f}: {ratio / local_ratio:.3f}x the "
        f"local executor's (goal <= 1.10x); the same-guarantee client's 256 tasks x 200 ms "
        f"on 2 workers x 128: {guarded:.3f}, {guarded / local_ratio:.3f}x the local "
        f"executor's, asyncgraph {ratio / guarded:.3f}x it; the client's own CPU a node in "
        f"that pass (median): asyncgraph {figures['wide_client_cpu'] * 1e6:.0f} us, the "
        f"same-guarantee client {figures['guarded_wide_client_cpu'] * 1e6:.0f} us"
    )
    print("against the same-guarantee client (goals), and the plain one (the floor):")
    for backend in ("asyncio", "trio", "sync"):
        name = "sync no-op, asyncio" if backend == "sync" else backend
        parts = []
        for base in ("guarded", "raw"):
            rt = figures[f"ag_{backend}_median"] / figures[f"{base}_median"]
            t1 = figures[f"ag_{backend}_one"] / figures[f"{base}_one"]
            t2 = figures[f"ag_{backend}_two"] / figures[f"{base}_two"]
            goals = " (goals <= 1.3x, >= 80%)" if base == "guarded" else ""
            parts.append(
                f"{'same-guarantee' if base == 'guarded' else 'plain'}: round trip {rt:.2f}x, "
                f"throughput {t1:.0%} with 1 worker, {t2:.0%} with 2{goals}"
            )
        print(f"  asyncgraph ({name}) " + "; ".join(parts))
    nan = float("nan")
    for peer in ("arq", "saq"):  # the peers, against the same baselines (no goal)
        if f"{peer}_one" not in figures:
            continue
        parts = []
        for base in ("guarded", "raw"):
            rt = figures[f"{peer}_median"] / figures[f"{base}_median"]
            t1 = figures[f"{peer}_one"] / figures[f"{base}_one"]
            t2 = figures.get(f"{peer}_two", float("nan")) / figures[f"{base}_two"]
            parts.append(
                f"{'same-guarantee' if base == 'guarded' else 'plain'}: round trip {rt:.2f}x, "
                f"throughput {t1:.0%} with 1 worker, {t2:.0%} with 2"
            )
        print(f"  {peer} (tuned; checks no signature, claims nothing) " + "; ".join(parts))
        ours = [
            f"{backend}: throughput {figures[f'ag_{backend}_one'] / figures[f'{peer}_one']:.1f}x"
            f" with 1 worker, {figures[f'ag_{backend}_two'] / figures.get(f'{peer}_two', nan):.1f}x"
            f" with 2, round trip {figures[f'ag_{backend}_median'] / figures[f'{peer}_median']:.2f}x"
            for backend in ("asyncio", "trio")
        ]
        print(f"  asyncgraph against {peer}: " + "; ".join(ours))
    for backend in ("asyncio", "trio"):
        c1, c2 = figures[f"ag_{backend}_cpu1"], figures[f"ag_{backend}_cpu2"]
        g1, g2 = figures["guarded_cpu1"], figures["guarded_cpu2"]
        r1, r2 = figures["raw_cpu1"], figures["raw_cpu2"]
        print(
            f"  CPU per task, client + workers + redis-server ({backend}): {c1 * 1e6:.0f} us with "
            f"1 worker, {c2 * 1e6:.0f} us with 2; same-guarantee {g1 * 1e6:.0f} / "
            f"{g2 * 1e6:.0f} us: {c1 / g1:.2f}x and {c2 / g2:.2f}x (goal <= 1.3x); plain "
            f"{r1 * 1e6:.0f} / {r2 * 1e6:.0f} us: {c1 / r1:.2f}x and {c2 / r2:.2f}x"
        )


def measure_peers(
    url: str,
    latency_n: int,
    tasks: int,
    row: Callable[..., None],
    rows: list[tuple[str, str, str, str, str]],
    figures: dict[str, float],
    flush: Callable[[], object],
) -> None:
    """arq and saq at tuned settings, each with 1 and 2 workers (a failure is a row)."""
    for name in ("arq", "saq"):
        try:
            __import__(name)
        except ImportError:
            rows.append((name, "skipped", f"({name} not installed)", "", ""))
            continue
        flush()
        script = str(HERE / f"dist_{name}.py")
        worker = [sys.executable, script, "worker", url]
        note = ""
        with processes([worker]):
            try:
                times, one = other(script, url, latency_n, tasks)
            except Exception as exc:  # a comparison must not sink the run
                rows.append((name, "failed", f"{type(exc).__name__}: {exc}"[:60], "", ""))
                continue
            try:
                with processes([worker]):
                    _, two = other(script, url, 10, tasks)
            except Exception as exc:  # report what worked
                two, note = None, f"2 workers: {type(exc).__name__}"
        row(f"{name} (tuned)", times, one, two, note)
        figures[f"{name}_median"], figures[f"{name}_one"] = stats(times)[0], one
        if two is not None:
            figures[f"{name}_two"] = two


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-others", action="store_true", help="skip arq and saq")
    parser.add_argument(
        "--allow-no-hiredis", action="store_true", help="run with a pure-Python raw baseline"
    )
    parser.add_argument(
        "--unsigned", action="store_true", help="run asyncgraph without a secret (no HMAC)"
    )
    args = parser.parse_args()
    # The workers inherit it; open_redis_executor reads it (secret=None).
    os.environ["ASYNCGRAPH_SECRET"] = "" if args.unsigned else SECRET
    import redis.utils

    if not redis.utils.HIREDIS_AVAILABLE and not args.allow_no_hiredis:
        print(
            "the raw baseline must be redis-py with hiredis, as its users run it: "
            'pip install -e ".[bench-redis]" (or pass --allow-no-hiredis)',
            file=sys.stderr,
        )
        return 2
    parser_name = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure Python (no hiredis)"
    print(f"raw baselines: redis-py {redis.__version__} asyncio, {parser_name} parser")
    print(f"asyncgraph {'unsigned' if args.unsigned else 'signed (HMAC-SHA256)'}")
    print(f"load average at the start: {loadavg()}", flush=True)
    lat_n = 200 if args.quick else 1000
    tasks = 5000
    rows: list[tuple[str, str, str, str, str]] = []
    figures: dict[str, float] = {}

    def row(
        name: str, times: list[float] | None, one: float | None, two: float | None, note: str = ""
    ) -> None:
        med, p99 = stats(times) if times else (float("nan"), float("nan"))
        rows.append(
            (
                name,
                f"{med:7.3f}",
                f"{p99:7.3f}",
                f"{one:8.0f}" if one else "       -",
                (f"{two:8.0f}" if two else "       -") + (f"  {note}" if note else ""),
            )
        )

    with RedisServer() as server:
        url = server.url
        redis_pid = server._proc.pid if server._proc is not None else None
        assert redis_pid is not None
        flush = redis.Redis.from_url(url).flushall

        # In-process reference.
        local = LocalExecutor()
        times = anyio.run(graph_latency, local, lat_n)
        rate = anyio.run(graph_throughput, local, tasks)
        figures["local_rate"] = rate
        row("asyncgraph local executor", times, rate, None, "(in-process)")

        # Round trips, interleaved with the raw baseline's in rounds so that both see the
        # same machine (a shared 2-core host is noisy); both fleets idle meanwhile.
        import dist_raw

        flush()
        raw = [sys.executable, str(HERE / "dist_raw.py"), "worker", url]
        guarded = [*raw, "--guarded"]
        round_trips: dict[str, list[float]] = {
            "asyncio": [],
            "trio": [],
            "sync": [],
            "raw": [],
            "guarded": [],
        }
        with (
            processes(asyncgraph_workers(url, 1, 256), workers_alive(url, 1)),
            processes([raw]),
            processes([guarded]),
        ):
            for _ in range(5):
                for backend in ("asyncio", "trio"):
                    round_trips[backend] += run_remote(
                        url, lambda ex: graph_latency(ex, lat_n // 5), backend
                    )
                round_trips["sync"] += run_remote(
                    url, lambda ex: graph_latency(ex, lat_n // 5, F.SyncNoop)
                )
                round_trips["raw"] += asyncio.run(dist_raw.latency(url, lat_n // 5))
                round_trips["guarded"] += asyncio.run(dist_raw.latency(url, lat_n // 5, True))

        # asyncgraph: 1 worker, then 2.
        for backend in ("asyncio", "trio"):
            flush()
            with processes(asyncgraph_workers(url, 1, 256), workers_alive(url, 1)) as first:
                times = round_trips[backend]
                one, cpu1 = with_cpu(
                    [redis_pid, *(p.pid for p in first)],
                    lambda b=backend: run_remote(url, lambda ex: graph_throughput(ex, tasks), b),
                    3 * tasks,
                )
                with processes(asyncgraph_workers(url, 1, 256), workers_alive(url, 2)) as second:
                    two, cpu2 = with_cpu(
                        [redis_pid, *(p.pid for p in first + second)],
                        lambda b=backend: run_remote(
                            url, lambda ex: graph_throughput(ex, tasks), b
                        ),
                        3 * tasks,
                    )
            figures[f"ag_{backend}_median"] = stats(times)[0]
            figures[f"ag_{backend}_one"], figures[f"ag_{backend}_two"] = one, two
            figures[f"ag_{backend}_cpu1"], figures[f"ag_{backend}_cpu2"] = cpu1, cpu2
            row(f"asyncgraph Redis ({backend} client)", times, one, two)

        flush()  # a synchronous no-op: the same, plus a thread hop on the worker
        with processes(asyncgraph_workers(url, 1, 256), workers_alive(url, 1)):
            one = run_remote(url, lambda ex: graph_throughput(ex, tasks, fn=F.SyncNoop))
            with processes(asyncgraph_workers(url, 1, 256), workers_alive(url, 2)):
                two = run_remote(url, lambda ex: graph_throughput(ex, tasks, fn=F.SyncNoop))
        figures["ag_sync_median"] = stats(round_trips["sync"])[0]
        figures["ag_sync_one"], figures["ag_sync_two"] = one, two
        row("asyncgraph Redis (sync no-op)", round_trips["sync"], one, two, "(worker thread)")

        flush()
        wide_raw = [*raw, "128", "--guarded"]
        with (
            processes(asyncgraph_workers(url, 2, 128), workers_alive(url, 2)),
            processes([wide_raw, wide_raw]),
        ):
            run_remote(url, lambda ex: sleepers(ex, 16, 0.01))  # warm up
            # Each remote pass next to a local one and the same-guarantee client's: all meet
            # the same moments of the machine.
            remote, local_ratios, guarded_wide = [], [], []
            for _ in range(2 if args.quick else 3):
                remote.append(run_remote(url, wide_pass))
                local_ratios.append(anyio.run(sleepers, local))
                guarded_wide.append(asyncio.run(dist_raw.wide(url, guarded=True)))
        figures["critical_path_ratio"] = min(r for r, _ in remote)
        figures["guarded_critical_path_ratio"] = min(r for r, _ in guarded_wide)
        figures["wide_client_cpu"] = statistics.median(c for _, c in remote)
        figures["guarded_wide_client_cpu"] = statistics.median(c for _, c in guarded_wide)
        local_ratio = min(local_ratios)

        # Hand-written redis-py streams: the same-guarantee client, then the plain one.
        for base, argv in (("guarded", guarded), ("raw", raw)):
            is_guarded = base == "guarded"
            flush()
            with processes([argv]) as first:
                _, _, piped_one = asyncio.run(dist_raw.measure(url, 10, tasks, is_guarded))
                one, cpu1 = with_cpu(
                    [redis_pid, *(p.pid for p in first)],
                    lambda g=is_guarded: asyncio.run(dist_raw.throughput(url, tasks, guarded=g)),
                    3 * tasks,
                )
                with processes([argv]) as second:
                    _, _, piped_two = asyncio.run(dist_raw.measure(url, 10, tasks, is_guarded))
                    two, cpu2 = with_cpu(
                        [redis_pid, *(p.pid for p in first + second)],
                        lambda g=is_guarded: asyncio.run(
                            dist_raw.throughput(url, tasks, guarded=g)
                        ),
                        3 * tasks,
                    )
            figures[f"{base}_cpu1"], figures[f"{base}_cpu2"] = cpu1, cpu2
            times = round_trips[base]
            figures[f"{base}_median"], figures[f"{base}_one"] = stats(times)[0], one
            figures[f"{base}_two"] = two
            name = "same guarantees" if is_guarded else "plain"
            row(f"raw redis-py streams, {name}", times, one, two)
            row(f"raw redis-py streams, {name}, 1 pipeline", None, piped_one, piped_two)

        if not args.no_others:
            measure_peers(url, min(lat_n, 300), tasks, row, rows, figures, flush)

    report(rows, figures, local_ratio)
    print(f"load average at the end: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
