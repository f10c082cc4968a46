"""Benchmark: two processes share one rate limit through Redis against a strict server.

Starts a throwaway redis-server, a local OpenAI-protocol server that enforces a sliding
window limit (answering 429 beyond it), and N worker processes that each run many
concurrent ``OpenAIChat.complete`` calls as fast as the shared ``RateLimit`` allows, with
retries off so every 429 would show. Prints the achieved rate as a fraction of the limit
(goal >= 95%), the most requests seen in any window (must not exceed the limit) and the
number of 429s (goal: 0), then ``RESULT: PASS`` or ``RESULT: FAIL`` (exit status 1).

The default scales the provider's 600 requests / 60 s window down to 100 requests /
10 s (the same 600/min) so the window fills several times in a 30 s run;
``--window-s 60 --duration-s 130`` measures at full scale.

    python benchmarks/bench_ratelimit.py [--requests-per-minute 600] [--window-s 10]
        [--duration-s 30] [--workers 2] [--concurrency 8] [--margin-s 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="shared Redis rate limit vs a strict server")
    p.add_argument("--requests-per-minute", type=float, default=600.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8, help="concurrent calls per worker")
    p.add_argument(
        "--margin-s", type=float, default=0.1, help="RateLimit.margin_s (jitter allowance)"
    )
    # Worker mode (internal).
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--server-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--redis-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_worker(args: argparse.Namespace) -> None:
    import anyio

    from asyncgraph.models import ModelError, ModelRateLimitedError, OpenAIChat, RateLimit, Retry

    counts = {"ok": 0, "rate_limited": 0, "errors": 0}

    async def main() -> None:
        limit = RateLimit(
            requests_per_minute=args.requests_per_minute,
            window_s=args.window_s,
            margin_s=args.margin_s,
            redis_url=args.redis_url,
            name="bench",
        )
        model = OpenAIChat(
            "bench-model",
            base_url=args.server_url,
            api_key="bench",
            rate_limit=limit,
            retry=Retry(max_attempts=1),
            timeout_s=10,
            headers={"x-worker": args.worker},
        )
        async with model:
            await anyio.sleep(max(0.0, args.start_at - time.time()))
            deadline = anyio.current_time() + args.duration_s

            async def caller(i: int) -> None:
                n = 0
                while anyio.current_time() < deadline:
                    n += 1
                    try:
                        await model.complete(
                            [{"role": "user", "content": f"{args.worker}-{i}-{n}"}]
                        )
                        counts["ok"] += 1
                    except ModelRateLimitedError:
                        counts["rate_limited"] += 1
                    except ModelError:
                        counts["errors"] += 1

            with anyio.move_on_after(args.duration_s + 0.5):
                async with anyio.create_task_group() as tg:
                    for i in range(args.concurrency):
                        tg.start_soon(caller, i)

    anyio.run(main)
    print(json.dumps(counts), flush=True)


def run_benchmark(args: argparse.Namespace) -> None:
    from asyncgraph.distributed._redis_server import RedisServer
    from asyncgraph.models import RateLimit
    from asyncgraph.models._testing import OpenAITestServer

    limit = RateLimit(
        requests_per_minute=args.requests_per_minute, window_s=args.window_s, margin_s=args.margin_s
    )
    per_window = limit.requests_per_window
    interval = limit.request_interval_s()
    assert interval is not None
    print(
        f"limit: {args.requests_per_minute:g} requests/min = {per_window} per {args.window_s:g}s "
        f"sliding window (server answers 429 beyond it); {args.workers} worker processes x "
        f"{args.concurrency} concurrent calls, sharing one budget in Redis; {args.duration_s:g}s run"
    )
    print(
        f"limiter pace: one slot every {interval * 1000:.1f} ms "
        f"= {60 / interval / args.requests_per_minute:.1%} of the limit by design "
        f"(margin_s={args.margin_s:g})"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with (
        RedisServer() as redis_server,
        OpenAITestServer(requests_per_window=per_window, window_s=args.window_s) as server,
    ):
        start_at = time.time() + 2.0  # time for the workers to import and connect
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"w{i}",
                    "--server-url",
                    server.url,
                    "--redis-url",
                    redis_server.url,
                    "--start-at",
                    repr(start_at),
                    "--duration-s",
                    repr(args.duration_s),
                    "--requests-per-minute",
                    repr(args.requests_per_minute),
                    "--window-s",
                    repr(args.window_s),
                    "--margin-s",
                    repr(args.margin_s),
                    "--concurrency",
                    str(args.concurrency),
                ],
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for i in range(args.workers)
        ]
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=args.duration_s + 60)
            if proc.returncode != 0:
                raise SystemExit(f"worker failed with exit code {proc.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        records = server.requests
        max_window = server.max_in_window()

    ok = [r for r in records if r.status == 200]
    n429 = sum(1 for r in records if r.status == 429)
    if not ok:
        print(f"no request was accepted ({len(records)} sent, {n429} answered 429)")
        print("RESULT: FAIL")
        raise SystemExit(1)
    first, last = ok[0].arrived_s, ok[-1].arrived_s
    per_worker = {
        w: sum(1 for r in ok if r.headers.get("x-worker") == w)
        for w in sorted({r.headers.get("x-worker", "?") for r in ok})
    }
    steady = (len(ok) - 1) / (last - first) * 60 if last > first else 0.0
    print(f"accepted requests: {len(ok)} (per worker: {per_worker}); worker reports: {results}")
    print(
        f"achieved rate: {steady:.1f} requests/min over {last - first:.1f}s "
        f"= {steady / args.requests_per_minute:.1%} of the limit (goal >= 95%)"
    )
    print(f"max requests in any {args.window_s:g}s window: {max_window} (limit {per_window})")
    print(f"429 responses: {n429} (goal 0)")
    good = steady >= 0.95 * args.requests_per_minute and n429 == 0 and max_window <= per_window
    print("RESULT:", "PASS" if good else "FAIL")
    if not good:
        raise SystemExit(1)


if __name__ == "__main__":
    ns = parse_args()
    if ns.worker:
        run_worker(ns)
    else:
        run_benchmark(ns)
