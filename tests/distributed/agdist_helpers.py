"""Helpers of tests/distributed: real ``asyncgraph worker`` processes, polling, shared scenarios."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import redis

from asyncgraph.models._testing import OpenAITestServer, Reply

HERE = Path(__file__).resolve().parent
SECRET = "0123456789abcdef-test-secret"
FAST = ("--lease-ms", "1000", "--drain-timeout-s", "1")  # reruns within a second or two


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


def wait_for_workers(url: str, queue: str, count: int, timeout_s: float = 120.0) -> None:
    """Block until ``count`` workers of ``queue`` sent a heartbeat (a deadline that holds
    while a worker's interpreter starts on a loaded machine)."""
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

ACL_PAGE = HERE.parents[1] / "docs" / "how-to" / "fleet.md"
ACL_ROLES = ("worker", "client", "status")


def documented_acl_roles(major: int = 7) -> dict[str, list[str]]:
    """Each Redis user role of docs/how-to/fleet.md (``ACL SETUSER asyncgraph-<role> ...``)
    as rules for a server of version ``major``: on Redis 6.2, which has no read-only key
    patterns, each ``%R~`` is written ``~``, as the page says."""
    import re

    found = re.findall(r"^ACL SETUSER asyncgraph-(\w+) (.*)$", ACL_PAGE.read_text(), re.MULTILINE)
    roles = {role: rules.split() for role, rules in found}
    assert sorted(roles) == sorted(ACL_ROLES), f"docs/how-to/fleet.md lists roles {sorted(roles)}"
    if major < 7:
        roles = {
            r: [f"~{x[3:]}" if x.startswith("%R~") else x for x in v] for r, v in roles.items()
        }
    return roles


class NumberedServer(OpenAITestServer):
    """Answers ``"answer <n> to <prompt>"``, n counting requests: a new call is visible."""

    def __init__(self) -> None:
        self._count = itertools.count(1)
        self._lock = threading.Lock()
        super().__init__(handler=self._numbered)

    def _numbered(self, body: Any) -> Reply:
        with self._lock:
            n = next(self._count)
        return Reply(text=f"answer {n} to {body['messages'][-1]['content']}")


def _llen(url: str, key: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.llen(key))
    finally:
        client.close()


async def kill_after_the_call_then_rerun(
    url: str,
    start_worker: StartWorker,
    server: OpenAITestServer,
    queue: str,
    tag: str,
    *,
    new_prompt: str | None = None,
    tamper: Callable[[redis.Redis], None] | None = None,
    fleet_url: str | None = None,
    client_url: str | None = None,
    secret: str = "",
    rerun_flags: tuple[str, ...] = (),
) -> tuple[float, Any]:
    """Run ``AskThenHold`` on a worker, SIGKILL it once its model call returned (the task
    holds before its reply), let another worker rerun it; the leaf's grad and the usage
    (the call journal's scenario: tests/distributed/test_call_journal.py).

    ``url`` is the admin's (the test's own reads and ``tamper(client)``, run between the
    kill and the rerun); the workers connect with ``fleet_url`` and the client with
    ``client_url`` (both ``url`` by default: other users under an ACL), signed with
    ``secret`` when given."""
    import agdist_functions as F

    from asyncgraph import Parameter, backward
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.distributed.wire._keys import workers_hash
    from asyncgraph.models import track_usage

    client = redis.Redis.from_url(url)
    client.set(f"agdist:hold:{tag}", 1)
    env = {"AGDIST_REDIS_URL": url, **({"ASYNCGRAPH_SECRET": secret} if secret else {})}

    def start(*flags: str) -> WorkerProcess:  # waited for as the admin: any ACL will do
        before = int(client.hlen(workers_hash(queue)))
        flags = (*FAST, "--allow-base-url", server.url, *flags)
        worker = start_worker(fleet_url or url, queue, *flags, env=env, wait=False)
        wait_for_workers(url, queue, before + 1)
        return worker

    first = start()
    x = Parameter(1.0, role="x")
    y = F.AskThenHold.apply(x, server.url, "what is one", tag)
    async with open_redis_executor(
        client_url or url, queue=queue, timeout_s=30, secret=secret
    ) as ex:
        with track_usage() as usage:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(backward, y, executor=ex))
                await wait_until(lambda: _llen(url, f"agdist:called:{tag}") == 1)
                assert len(server.requests) == 1  # the call returned: paid once
                first.kill()  # ... and its reply is never written
                if new_prompt is not None:
                    client.set(f"agdist:prompt:{tag}", new_prompt)
                if tamper is not None:
                    tamper(client)
                client.delete(f"agdist:hold:{tag}")
                start(*rerun_flags)
        assert ex.stats.completed == 1
    client.close()
    assert _llen(url, f"agdist:called:{tag}") == 2  # the task did run twice
    assert x.grad is not None
    return x.grad.data, usage.snapshot()


# A deadline that holds on a loaded machine (both cores busy with other work): a wait
# that fails before it is a fault found, never a slow machine's.
MIN_WAIT_S = 60.0


async def wait_until(predicate: Callable[[], Any], timeout_s: float = MIN_WAIT_S) -> Any:
    """Poll ``predicate`` (a quick local check) until it is truthy; fail after ``timeout_s``
    (at least ``MIN_WAIT_S``: a deadline, not a timing assertion)."""
    with anyio.fail_after(max(timeout_s, MIN_WAIT_S)):
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


async def check_limiter_and_cache(url: str, name: str, *, read_only_from: str = "") -> None:
    """The shared rate limiter (a Lua script) and the response cache work through ``url``;
    with ``read_only_from`` (an entry another user wrote), the cache only reads: a write
    is refused (NOPERM), the entry ``read_only_from`` is read."""
    import pytest

    from asyncgraph.models import Completion, ModelBackendError, RateLimit, RedisCache
    from asyncgraph.models._ratelimit import RedisRateLimiter

    limiter = RedisRateLimiter(RateLimit(requests_per_minute=600), name=name, redis_url=url)
    assert await limiter.reserve() >= 0.0
    await limiter.aclose()
    cache = RedisCache(url, ttl_s=60)
    if read_only_from:
        with pytest.raises(ModelBackendError, match=r"(?i)noperm|no permissions"):
            await cache.set(name, Completion("forged", "m"))
        name = read_only_from
    else:
        await cache.set(name, Completion(f"cached for {name}", "m"))
    got = await cache.get(name)
    assert got is not None and got.text == f"cached for {name}"
    await cache.aclose()
