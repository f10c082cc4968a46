"""Helpers of tests/distributed: real ``asyncgraph worker`` processes, polling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import redis

HERE = Path(__file__).resolve().parent
SECRET = "0123456789abcdef-test-secret"


class WorkerProcess:
    """One ``asyncgraph worker`` subprocess; stopped (killed if need be) at teardown."""

    def __init__(self, url: str, queue: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.queue = queue
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), *filter(None, [full_env.get("PYTHONPATH")])])
        full_env["AGDIST_REDIS_URL"] = url
        full_env.pop("ASYNCGRAPH_SECRET", None)
        full_env.update(env or {})
        self.args = [sys.executable, "-m", "asyncgraph", "worker", "--redis", url,
                     "--queue", queue, "--import", "agdist_functions", "--log-level", "WARNING",
                     *extra]
        self.proc = subprocess.Popen(self.args, env=full_env, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_for_workers(url: str, queue: str, count: int, timeout_s: float = 15.0) -> None:
    """Block until ``count`` workers of ``queue`` sent a heartbeat."""
    from asyncgraph.wire._keys import workers_hash

    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if client.hlen(workers_hash(queue)) >= count:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{count} worker(s) of queue {queue!r} did not start in {timeout_s}s")
    finally:
        client.close()


StartWorker = Callable[..., WorkerProcess]


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Poll ``predicate`` (a quick local check) until it is truthy; fail after ``timeout_s``."""
    with anyio.fail_after(timeout_s):
        while True:
            value = predicate()
            if value:
                return value
            await anyio.sleep(0.05)
