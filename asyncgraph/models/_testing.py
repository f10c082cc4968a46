"""A real, scriptable HTTP server speaking the OpenAI chat completions protocol.

For tests and benchmarks (not for production): a threaded ``http.server`` on
127.0.0.1 that answers ``POST /v1/chat/completions``. By default it echoes the last
message with word-count usage; ``script(Reply(...), ...)`` queues answers such as a 429
with Retry-After, a 500, a slow answer or a dropped connection; ``requests_per_window``
makes it enforce a sliding-window rate limit like a provider (429 beyond it). Every
request is recorded with its arrival time, and every answer it computed is on its
bill (``bill``, ``billed_usd``), as a provider bills: the tokens in and out of each
answer, whether or not its client was still there to read it (a client that went away
mid-request is billed all the same; an error status, a dropped connection and a
scripted ``body`` are not)::

    with OpenAITestServer() as server:
        server.script(Reply(status=500), Reply(text="hello"))
        model = OpenAIChat("test-model", base_url=server.url, api_key="test")
        ...
        assert [r.status for r in server.requests] == [500, 200]
        print(server.billed_usd(Pricing(0.15, 0.60)))

Run ``python -m asyncgraph.models._testing --port 8000`` to serve it by hand. Other
providers' fakes (``asyncgraph.models._testing_providers``: Anthropic, Azure OpenAI)
are subclasses that replace the protocol methods (``_refuse``, ``_answer``, ``_error``,
``_limited``).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

__all__ = ["Billed", "OpenAITestServer", "RecordedRequest", "Reply", "echo_text"]

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """One scripted answer.

    ``status`` 200 answers a chat completion with ``text`` (default: ``echo_text`` of the
    request); another status answers an OpenAI-style error body whose message is
    ``error`` (default: a generic one). ``headers`` are added (e.g. ``{"Retry-After":
    "1"}``); ``body`` replaces the whole body (bytes, for malformed answers). The server
    waits ``delay_s`` first (cut short when it stops); ``drop=True`` closes the connection
    without answering. ``usage`` is merged into the answer's usage object (e.g.
    ``{"prompt_tokens_details": {"cached_tokens": 3}}``); ``error_type`` replaces the
    error body's type (Anthropic's ``error.type``, Azure's ``error.code``).
    """

    status: int = 200
    text: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None
    body: bytes | None = None
    delay_s: float = 0.0
    drop: bool = False
    usage: Mapping[str, Any] | None = None
    error_type: str | None = None


@dataclass(frozen=True)
class RecordedRequest:
    """A request the server received: arrival ``time.monotonic()``, path, headers, JSON body,
    and the status it answered (``0`` for a dropped connection)."""

    arrived_s: float
    path: str
    headers: dict[str, str]
    body: Any
    status: int


@dataclass(frozen=True)
class Billed:
    """One answer the server computed, as a provider bills it: ``prompt_tokens`` (the
    prompt-cache's share included), ``completion_tokens``, and the part of the prompt
    read from / written to the prompt cache."""

    prompt_tokens: int
    completion_tokens: int
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def cost_usd(self, pricing: Any) -> float:
        """Its cost at ``pricing`` (an ``asyncgraph.models.Pricing``)."""
        return float(
            pricing.cost_usd(
                self.prompt_tokens,
                self.completion_tokens,
                self.cache_read_tokens,
                self.cache_write_tokens,
            )
        )


def billed_usage(answer: Any) -> Billed:
    """The bill of an answer's JSON: OpenAI's usage (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``) or Anthropic's (``input_tokens`` not cached,
    ``output_tokens``, ``cache_read_input_tokens``, ``cache_creation_input_tokens``)."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return Billed(0, 0)
    if "input_tokens" in usage:
        read = int(usage.get("cache_read_input_tokens") or 0)
        write = int(usage.get("cache_creation_input_tokens") or 0)
        prompt = int(usage.get("input_tokens") or 0) + read + write
        return Billed(prompt, int(usage.get("output_tokens") or 0), read, write)
    details = usage.get("prompt_tokens_details") or {}
    return Billed(
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        int(details.get("cached_tokens") or 0),
    )


def echo_text(body: Any) -> str:
    """The default answer: ``"echo: "`` plus the content of the last message."""
    try:
        return f"echo: {body['messages'][-1]['content']}"
    except (KeyError, IndexError, TypeError):
        return "echo: "


def _words(body: Any) -> int:
    try:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    except (KeyError, TypeError, AttributeError):
        return 0


# OpenAI's documented prompt-caching rule: a prompt of 1,024 tokens or more may be served
# from cache for the longest prefix seen before, counted in 128-token steps.
CACHE_MIN_TOKENS = 1024
CACHE_STEP_TOKENS = 128


def _prefix_keys(body: Any) -> list[str]:
    """Hashes of the prompt's prefixes at 1,024 tokens and every 128 after (a token is a
    word, as in the usage; a message's first word carries its role), with the model."""
    try:
        messages, model = body["messages"], str(body.get("model", ""))
        tokens = [
            f"{m.get('role')}:{word}" if i == 0 else word
            for m in messages
            for i, word in enumerate(str(m.get("content", "")).split())
        ]
    except (KeyError, TypeError, AttributeError):
        return []
    digest = hashlib.sha256(model.encode())
    keys = []
    for n, token in enumerate(tokens, 1):
        digest.update(b"\0" + token.encode())
        if n >= CACHE_MIN_TOKENS and (n - CACHE_MIN_TOKENS) % CACHE_STEP_TOKENS == 0:
            keys.append(digest.copy().hexdigest())
    return keys


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A provider takes a step's connections at once; with socketserver's backlog of 5,
    # some of a burst of 15 new ones waited a second for a SYN retransmit (or were reset).
    request_queue_size = 128
    owner: OpenAITestServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body waits for the
    # client's delayed ACK, 40 ms per request on Linux loopback.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.server.owner._handle(self)

    def do_GET(self) -> None:
        self.server.owner._get(self)


def _read_request(req: _Handler) -> tuple[Any, dict[str, str]]:
    """A POST's JSON body (None when it is not JSON) and its headers, names lower-cased."""
    length = int(req.headers.get("content-length") or 0)
    raw = req.rfile.read(length) if length else b""
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = None
    return body, {k.lower(): v for k, v in req.headers.items()}


def _error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class OpenAITestServer:
    """See the module docstring. ``url`` is the ``base_url`` to give ``OpenAIChat``.

    ``requests_per_window`` / ``window_s``: answer 429 (with Retry-After) to a request
    when ``requests_per_window`` requests were already let through in the last
    ``window_s`` seconds; the 429s it answers do not count. ``handler(body) -> Reply | None`` decides
    answers after the scripted queue is empty (``None`` = default echo).

    ``prompt_cache=True`` applies OpenAI's documented caching rule: an answer reports
    ``usage.prompt_tokens_details.cached_tokens``, the longest prefix of its prompt that
    an earlier answered request had too, if 1,024 tokens or more, in 128-token steps
    (tokens counted as the usage counts them: words; prefixes of another model's
    requests do not count).
    """

    def __init__(
        self,
        *,
        requests_per_window: int | None = None,
        window_s: float = 60.0,
        handler: Callable[[Any], Reply | None] | None = None,
        prompt_cache: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.requests_per_window = requests_per_window
        self.prompt_cache = prompt_cache
        self._seen_prefixes: set[str] = set()
        self.window_s = window_s
        self.handler = handler
        self._host, self._port = host, port
        self._cond = threading.Condition()
        self._script: collections.deque[Reply] = collections.deque()
        self._requests: list[RecordedRequest] = []
        self._bill: list[Billed] = []
        self._accepted: collections.deque[float] = collections.deque()
        self._stopping = threading.Event()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Self:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        httpd = _Server((self._host, self._port), _Handler)
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("OpenAITestServer is not running: call start() or use `with`")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}/v1"

    # -- scripting and records ---------------------------------------------------------

    def script(self, *replies: Reply) -> None:
        """Queue answers for the next requests, in order."""
        with self._cond:
            self._script.extend(replies)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in order of arrival."""
        with self._cond:
            return sorted(self._requests, key=lambda r: r.arrived_s)

    @property
    def bill(self) -> list[Billed]:
        """Every answer computed so far, in the order computed (see the module docstring)."""
        with self._cond:
            return list(self._bill)

    def billed_usd(self, pricing: Any) -> float:
        """What the answers computed so far cost at ``pricing`` (an ``asyncgraph.models.Pricing``)."""
        return math.fsum(billed.cost_usd(pricing) for billed in self.bill)

    def wait_for_bill(self, count: int, timeout_s: float = 10.0) -> bool:
        """Block until ``count`` answers were computed (billed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._bill) >= count, timeout_s)

    def statuses(self) -> list[int]:
        return [r.status for r in self.requests]

    def wait_for_requests(self, count: int, timeout_s: float = 10.0) -> bool:
        """Block until ``count`` requests were received; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._requests) >= count, timeout_s)

    def max_in_window(self, window_s: float | None = None) -> int:
        """The most accepted (200) requests that arrived within any ``window_s`` span."""
        span = self.window_s if window_s is None else window_s
        times = sorted(r.arrived_s for r in self.requests if r.status == 200)
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while times[lo] <= t - span:
                lo += 1
            best = max(best, hi - lo + 1)
        return best

    # -- serving -----------------------------------------------------------------------

    def _get(self, req: _Handler) -> None:
        """The answer to a GET (OpenAI's API serves none here)."""
        self._send_json(req, 404, _error_body("not found", "invalid_request_error"), {})

    def _handle(self, req: _Handler) -> None:
        body, headers = _read_request(req)
        reply, arrived = self._decide(req.path, body, headers)
        # Recorded before answering: once the client has its answer, the record exists.
        status = 0 if reply.drop else reply.status
        self._record(RecordedRequest(arrived, req.path, headers, body, status))
        streamed = reply.status == 200 and reply.body is None and not reply.drop
        if streamed and self._streamed(body):  # it times its events itself
            self._stream(req, reply, body, arrived)
            return
        if reply.delay_s > 0:
            self._stopping.wait(reply.delay_s)
        if reply.drop:
            req.close_connection = True
            return
        if reply.body is not None:
            self._send(req, reply.status, reply.body, reply.headers)
        elif reply.status == 200:
            answer = self._answer(reply, req.path, body)
            # Billed once computed, as a provider does: whether its client still reads or not.
            self._billed(answer)
            self._send_json(req, 200, answer, reply.headers)
        else:
            message = reply.error or f"test server answered HTTP {reply.status}"
            self._send_json(req, reply.status, self._error(reply, message), reply.headers)

    # -- the protocol (what a subclass for another API replaces) -------------------------

    def _refuse(self, path: str, body: Any, headers: Mapping[str, str]) -> Reply | None:
        """The error answer to a request the protocol rejects (wrong path, missing key,
        malformed body), else None. OpenAI's: only the path is checked."""
        # The query is not the path: an Azure-style base URL carries ``?api-version=...``.
        if path.split("?", 1)[0].rstrip("/") != CHAT_PATH:
            return Reply(status=404, error=f"unknown path {path!r}; use POST {CHAT_PATH}")
        return None

    def _answer(self, reply: Reply, path: str, body: Any) -> Any:
        """The JSON of a successful answer."""
        text = reply.text if reply.text is not None else echo_text(body)
        model = body.get("model", "test-model") if isinstance(body, dict) else "test-model"
        prompt, completion = _words(body), len(text.split())
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.prompt_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": self._cached_tokens(body)}
        return {
            "id": f"chatcmpl-test-{len(self._requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {**usage, **(reply.usage or {})},
        }

    def _streamed(self, body: Any) -> bool:
        """Whether the request asks for its answer as a stream this fake serves (OpenAI's:
        never; ``stream`` is answered with one JSON body)."""
        return False

    def _stream(self, req: _Handler, reply: Reply, body: Any, arrived: float) -> None:
        """Answer a streamed request (``_streamed``); a subclass that streams says how."""
        raise NotImplementedError

    def _billed(self, answer: Any) -> None:
        """Put a computed answer on the bill (as a provider does, read or not)."""
        with self._cond:
            self._bill.append(billed_usage(answer))
            self._cond.notify_all()

    def _cached_tokens(self, body: Any) -> int:
        """Tokens of ``body``'s prompt served from the simulated cache; remembers its prefixes."""
        keys = _prefix_keys(body)
        with self._cond:
            hits = [i for i, key in enumerate(keys) if key in self._seen_prefixes]
            self._seen_prefixes.update(keys)
        return CACHE_MIN_TOKENS + CACHE_STEP_TOKENS * max(hits) if hits else 0

    def _error(self, reply: Reply, message: str) -> Any:
        """The JSON of an error answer."""
        kind = reply.error_type or (
            "rate_limit_exceeded" if reply.status == 429 else "invalid_request_error"
        )
        return _error_body(message, kind)

    def _limited(self, retry_after_s: int) -> Reply:
        return Reply(
            status=429,
            headers={"Retry-After": str(retry_after_s)},
            error=f"Rate limit reached: {self.requests_per_window} requests per {self.window_s:g}s",
        )

    def _decide(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[Reply, float]:
        """The answer to a request, and its arrival time (taken under the lock, so the
        sliding window sees arrivals in order)."""
        refused = self._refuse(path, body, headers)
        if refused is not None:
            return refused, time.monotonic()
        with self._cond:
            arrived = time.monotonic()
            if self.requests_per_window is not None:
                while self._accepted and self._accepted[0] <= arrived - self.window_s:
                    self._accepted.popleft()
                if len(self._accepted) >= self.requests_per_window:
                    wait = self._accepted[0] + self.window_s - arrived
                    return self._limited(max(1, math.ceil(wait))), arrived
                self._accepted.append(arrived)
            scripted = self._script.popleft() if self._script else None
        if scripted is None and self.handler is not None:
            scripted = self.handler(body)
        return scripted or Reply(), arrived

    def _record(self, record: RecordedRequest) -> None:
        with self._cond:
            self._requests.append(record)
            self._cond.notify_all()

    def _send_json(
        self, req: _Handler, status: int, payload: Any, headers: Mapping[str, str]
    ) -> None:
        self._send(req, status, json.dumps(payload).encode(), headers)

    def _send(self, req: _Handler, status: int, data: bytes, headers: Mapping[str, str]) -> None:
        try:
            req.send_response(status)
            if not any(name.lower() == "content-type" for name in headers):
                req.send_header("Content-Type", "application/json")
            req.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                req.send_header(name, value)
            req.end_headers()
            req.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            req.close_connection = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests-per-window", type=int, default=None)
    parser.add_argument("--window-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    with OpenAITestServer(
        port=args.port, requests_per_window=args.requests_per_window, window_s=args.window_s
    ) as server:
        print(f"serving the OpenAI chat protocol at {server.url} (Ctrl-C stops)", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
