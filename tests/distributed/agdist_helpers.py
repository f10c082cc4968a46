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

    def __init__(
        self, url: str, queue: str, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        self.url = url
        self.queue = queue
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), *filter(None, [full_env.get("PYTHONPATH")])]
        )
        full_env["AGDIST_REDIS_URL"] = url
        for name in (
            "ASYNCGRAPH_SECRET",
            "ASYNCGRAPH_ALLOWED_BASE_URLS",
            "OPENAI_API_KEY",
            "OPENAI_BASE_URL",
        ):
            full_env.pop(name, None)
        full_env.update(env or {})
        imports = [] if "--import" in extra else ["--import", "agdist_functions"]
        self.args = [
            sys.executable,
            "-m",
            "asyncgraph",
            "worker",
            "--redis",
            url,
            "--queue",
            queue,
            *imports,
            "--log-level",
            "WARNING",
            *extra,
        ]
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
    from asyncgraph.distributed.wire._keys import workers_hash

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


class CaptureServer:
    """An OpenAI-compatible HTTP server on 127.0.0.1 that records each request's headers.

    ``with CaptureServer() as server: server.base_url``; ``server.requests`` lists
    ``(path, authorization header)`` of every request. It answers every POST with a
    minimal chat completion.
    """

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        self.requests: list[tuple[str, str]] = []
        capture = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                capture.requests.append((self.path, self.headers.get("authorization") or ""))
                body = json.dumps(
                    {
                        "choices": [
                            {
                                "message": {"role": "assistant", "content": "captured"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    def __enter__(self) -> CaptureServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def http_get(port: int, path: str) -> tuple[int, str]:
    """``GET http://127.0.0.1:port/path``: status and body, also for 4xx/5xx; (0, error) if down."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), str(exc.read().decode())
    except OSError as exc:
        return 0, str(exc)


async def check_limiter_and_cache(url: str, name: str) -> None:
    """The shared rate limiter (a Lua script) and the response cache work through ``url``."""
    from asyncgraph.models import Completion, RateLimit, RedisCache
    from asyncgraph.models._ratelimit import RedisRateLimiter

    limiter = RedisRateLimiter(RateLimit(requests_per_minute=600), name=name, redis_url=url)
    assert await limiter.reserve() >= 0.0
    await limiter.aclose()
    cache = RedisCache(url, ttl_s=60)
    await cache.set(name, Completion(f"cached for {name}", "m"))
    got = await cache.get(name)
    assert got is not None and got.text == f"cached for {name}"
    await cache.aclose()
