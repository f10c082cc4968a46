"""A local worker fleet for ``asyncgraph demo --workers N`` and the benchmarks.

Starts an embedded ``redis-server`` (unless a URL is given) and one
``asyncgraph worker --processes N`` supervisor, waits until N workers have
announced themselves, and tears everything down on exit (SIGTERM, which lets
the workers drain, then SIGKILL after a deadline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import redis

from .._redis_server import RedisServer
from ..wire import _keys as keys

__all__ = ["local_fleet"]


def wait_for_workers(url: str, queue: str, count: int, *, timeout_s: float = 30.0,
                     proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until ``count`` workers of ``queue`` sent a heartbeat (deadline ``timeout_s``)."""
    client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the worker supervisor exited with code {proc.returncode} at start")
            announced: Any = client.hlen(keys.workers_hash(queue))  # sync client: an int
            if int(announced) >= count:
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"{count} worker(s) of queue {queue!r} did not start within {timeout_s}s")


@contextmanager
def local_fleet(
    processes: int,
    imports: Sequence[str],
    *,
    redis_url: str | None = None,
    queue: str = "grads",
    concurrency: int = 128,
    extra_args: Sequence[str] = (),
    quiet: bool = True,
) -> Iterator[str]:
    """Run ``processes`` local workers serving ``imports``; yields the Redis URL."""
    with ExitStack() as stack:
        url = redis_url or stack.enter_context(RedisServer()).url
        redis.Redis.from_url(url, socket_timeout=2.0).delete(keys.workers_hash(queue))
        args = [sys.executable, "-m", "asyncgraph", "worker", "--redis", url, "--queue", queue,
                "--processes", str(processes), "--concurrency", str(concurrency),
                *(arg for module in imports for arg in ("--import", module)), *extra_args]
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(args, stdout=out, stderr=out, env=dict(os.environ))
        try:
            wait_for_workers(url, queue, processes, proc=proc)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
