"""A local fake of a small model behind llama.cpp's or vLLM's OpenAI-compatible server.

For tests and benchmarks (not for production). ``LocalModelTestServer`` is an
``OpenAITestServer`` that answers as a small local model does, not as a prompt says:

- **prose, no tags**: a reply never holds the ``<IMPROVED_VARIABLE>`` tags a prompt asks
  for; an update request gets "Sure! Here is a better version: ..." in prose. A request
  with ``response_format`` (a JSON schema) gets JSON that follows the schema, as
  llama.cpp's grammar (or vLLM's guided decoding) forces it to; a request whose schema the
  server refuses (``json_schema=False``) gets llama.cpp's 400;
- **rambling**: without ``max_tokens`` a reply runs to ``ramble_tokens`` tokens (the
  client waits ``s_per_token`` for each), with it, to at most that many;
- **slots**: at most ``slots`` requests are worked on at once; the others wait in the
  server's queue (``max_busy`` and ``queued`` record it), as llama.cpp's ``-np`` slots do;
  a request whose client closed its connection is dropped, queued or at work, and its
  slot freed (``cancelled`` counts them), as llama.cpp's server does (its log says "stop:
  cancel task"; measured on llama-server for a running and a queued request) and vLLM's
  does; ``cancel_on_disconnect=False`` works it to its end instead, as a server that
  never looks back would;
- **a context window per slot** of ``n_ctx`` tokens (a token is 3.5 characters here,
  plus 5 per message): ``flavor="llama.cpp"`` refuses a prompt of ``n_ctx`` tokens or
  more with its ``exceed_context_size_error`` (HTTP 400, ``n_prompt_tokens``,
  ``n_ctx``) and cuts a reply at the window's end; ``flavor="vllm"`` refuses a prompt plus
  ``max_tokens`` beyond ``n_ctx`` with vLLM's "maximum context length" 400;
- **what it says of itself**: llama.cpp's ``GET /props`` (``default_generation_settings.n_ctx``
  per slot, ``total_slots``), vLLM's ``GET /v1/models`` (``max_model_len``).

Example::

    with LocalModelTestServer(slots=4, n_ctx=2048) as server:
        model = OpenAIChat("smollm2", base_url=server.url, api_key="")
        ...
        assert server.max_busy <= 4 and server.refused_for_context == 0
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from asyncgraph.models._testing import (
    CACHE_MIN_TOKENS,
    CACHE_STEP_TOKENS,
    CHAT_PATH,
    OpenAITestServer,
    RecordedRequest,
    Reply,
    _Handler,
    _prefix_keys,
    _read_request,
)
from asyncgraph.models._testing_providers import AnthropicTestServer

__all__ = [
    "LocalModelTestServer",
    "TimedAnthropicTestServer",
    "TimedOpenAITestServer",
    "local_tokens",
    "schema_value",
]

_CHARS_PER_TOKEN = 3.5
_PER_MESSAGE = 5
_VARIABLE = re.compile(r"<VARIABLE(?:_A)?>(.*?)</VARIABLE(?:_A)?>", re.DOTALL)
_PROSE = (
    "Sure! I would be happy to help with that. Here is what I think about it, step by step, "
    "with some more words than needed, as a small model tends to write when nothing stops "
    "it, going on and on about the question and the answer and the feedback. "
)


def local_tokens(body: Any) -> int:
    """A request's prompt tokens as this server counts them (3.5 characters a token, plus
    5 a message)."""
    try:
        messages = body["messages"]
        chars = sum(len(_text(m.get("content", ""))) for m in messages)
        return math.ceil(chars / _CHARS_PER_TOKEN) + _PER_MESSAGE * len(messages)
    except (KeyError, TypeError, AttributeError):
        return 0


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def schema_value(schema: Any, prose: str) -> Any:
    """A value that follows ``schema`` (what a grammar-constrained model produces), its
    strings filled with ``prose``."""
    if not isinstance(schema, Mapping):
        return prose
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema:
        return schema_value(schema["anyOf"][0], prose)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: schema_value(sub, prose) for name, sub in props.items()}
    if kind == "array":
        return [schema_value(schema.get("items"), prose)]
    if kind == "integer":
        return max(int(schema.get("minimum", 7)), 7)
    if kind == "number":
        return 0.5
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return prose


class LocalModelTestServer(OpenAITestServer):
    """See the module docstring. ``improve(value) -> str`` says what an update request's
    value becomes (default: the value with " Be precise." added once)."""

    def __init__(
        self,
        *,
        slots: int = 4,
        n_ctx: int = 2048,
        flavor: str = "llama.cpp",
        ramble_tokens: int = 181,
        s_per_token: float = 0.0,
        json_schema: bool = True,
        improve: Callable[[str], str] | None = None,
        model: str = "smollm2",
        cancel_on_disconnect: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if flavor not in ("llama.cpp", "vllm"):
            raise ValueError(f"flavor must be 'llama.cpp' or 'vllm', got {flavor!r}")
        super().__init__(host=host, port=port)
        self.slots = slots
        self.n_ctx = n_ctx
        self.flavor = flavor
        self.ramble_tokens = ramble_tokens
        self.s_per_token = s_per_token
        self.json_schema = json_schema
        self.improve = improve or (lambda v: v if "Be precise." in v else f"{v} Be precise.")
        self.model = model
        self._slot_sem = threading.BoundedSemaphore(slots)
        self._busy = 0
        self.max_busy = 0
        """The most requests worked on at once."""
        self.queued = 0
        """Requests that waited for a slot."""
        self.refused_for_context = 0
        self.cancel_on_disconnect = cancel_on_disconnect
        self.cancelled = 0
        """Requests dropped because their client went away (``cancel_on_disconnect``)."""
        self.completion_tokens: list[int] = []
        """The completion tokens of each answer, in order."""

    # -- what the server says of itself ------------------------------------------------

    def _get(self, req: _Handler) -> None:
        path = req.path.split("?", 1)[0].rstrip("/")
        if path == "/props" and self.flavor == "llama.cpp":
            props = {
                "default_generation_settings": {"n_ctx": self.n_ctx, "params": {}},
                "total_slots": self.slots,
                "model_path": f"/models/{self.model}.gguf",
            }
            self._send_json(req, 200, props, {})
        elif path == "/v1/models":
            row: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "local"}
            if self.flavor == "vllm":
                row["max_model_len"] = self.n_ctx
            self._send_json(req, 200, {"object": "list", "data": [row]}, {})
        else:
            self._send_json(req, 404, {"error": {"code": 404, "message": "File Not Found"}}, {})

    # -- serving -----------------------------------------------------------------------

    def _handle(self, req: _Handler) -> None:
        body, headers = _read_request(req)
        arrived = time.monotonic()
        if req.path.split("?", 1)[0].rstrip("/") != CHAT_PATH or not isinstance(body, dict):
            self._record(RecordedRequest(arrived, req.path, headers, body, 404))
            self._send_json(req, 404, {"error": {"code": 404, "message": "File Not Found"}}, {})
            return
        if not self._slot_sem.acquire(blocking=False):
            with self._cond:
                self.queued += 1
            while not self._slot_sem.acquire(timeout=0.02):
                if self._gone(req):
                    self._record(RecordedRequest(arrived, req.path, headers, body, 0))
                    return
        with self._cond:
            self._busy += 1
            self.max_busy = max(self.max_busy, self._busy)
        try:
            status, payload, delay = self._work(body)
            self._record(RecordedRequest(arrived, req.path, headers, body, status))
            done = time.monotonic() + delay
            # The slot is busy all this time, unless the client goes away.
            while not self._stopping.wait(min(0.02, max(0.0, done - time.monotonic()))):
                if time.monotonic() >= done:
                    break
                if self._gone(req):
                    return
        finally:
            with self._cond:
                self._busy -= 1
            self._slot_sem.release()
        self._send_json(req, status, payload, {})

    def _gone(self, req: _Handler) -> bool:
        """Whether the client closed the connection of ``req`` (it asked nothing more on
        it: readable with nothing to read is its end), counted as cancelled; always
        False without ``cancel_on_disconnect``."""
        if not self.cancel_on_disconnect:
            return False
        try:  # nothing to read yet: alive; end of stream: gone
            peeked: bytes = req.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            gone = peeked == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            req.close_connection = True
            with self._cond:
                self.cancelled += 1
                self._cond.notify_all()
        return gone

    def wait_for_cancelled(self, count: int, timeout_s: float = 10.0) -> bool:
        """Wait until ``count`` requests were cancelled (False if ``timeout_s`` ran out)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.cancelled >= count, timeout_s)

    def _refusal(self, prompt: int, max_tokens: int | None) -> dict[str, Any] | None:
        if self.flavor == "llama.cpp" and prompt >= self.n_ctx:
            return {
                "error": {
                    "code": 400,
                    "message": (
                        f"request ({prompt} tokens) exceeds the available context size "
                        f"({self.n_ctx} tokens), try increasing it"
                    ),
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": prompt,
                    "n_ctx": self.n_ctx,
                }
            }
        completion = max_tokens if max_tokens is not None else 0
        if self.flavor == "vllm" and prompt + completion > self.n_ctx:
            return {
                "error": {
                    "message": (
                        f"This model's maximum context length is {self.n_ctx} tokens. However, "
                        f"you requested {prompt + completion} tokens ({prompt} in the messages, "
                        f"{completion} in the completion). Please reduce the length of the "
                        "messages or completion."
                    ),
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            }
        return None

    def _work(self, body: dict[str, Any]) -> tuple[int, Any, float]:
        """The status, JSON and generation time of an answer to ``body``."""
        prompt = local_tokens(body)
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        limit = limit if isinstance(limit, int) and limit > 0 else None
        refused = self._refusal(prompt, limit)
        if refused is not None:
            with self._cond:
                self.refused_for_context += 1
            return 400, refused, 0.0
        room = self.n_ctx - prompt
        budget = min(self.ramble_tokens, limit or self.ramble_tokens, room)
        response_format = body.get("response_format")
        spec = response_format.get("json_schema") if isinstance(response_format, dict) else None
        if isinstance(spec, dict):
            if not self.json_schema:
                error = {
                    "code": 400,
                    "message": "response_format is not supported",
                    "type": "invalid_request_error",
                }
                return 400, {"error": error}, 0.0
            text = json.dumps(schema_value(spec.get("schema"), self._value(body)))
        else:
            text = self._prose(body, budget)
        completion = min(budget, max(1, math.ceil(len(text) / _CHARS_PER_TOKEN)))
        with self._cond:
            self.completion_tokens.append(completion)
        answer = {
            "id": f"chatcmpl-local-{len(self._requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if completion >= budget and not spec else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
        return 200, answer, completion * self.s_per_token

    def _value(self, body: dict[str, Any]) -> str:
        """The string a grammar-bound reply holds: an update request's improved value, or
        a short verdict."""
        everything = "\n".join(_text(m.get("content", "")) for m in body["messages"])
        found = _VARIABLE.findall(everything)
        if found:
            return self.improve(found[-1].strip())
        return "The answer looks right."

    def _prose(self, body: dict[str, Any], budget: int) -> str:
        """What a small model writes without a grammar: prose, no tags, up to ``budget``."""
        everything = "\n".join(_text(m.get("content", "")) for m in body["messages"])
        found = _VARIABLE.findall(everything)
        text = (
            f"Sure! Here is a better version: {self.improve(found[-1].strip())} " if found else ""
        )
        text += _PROSE * (1 + budget * 4 // len(_PROSE))
        return text[: max(1, int(budget * _CHARS_PER_TOKEN))]


# -- prompt caches that become readable only once a first request was worked on ---------


class _Readable:
    """When each cached prefix becomes readable: ``ready_s`` after the request that wrote
    it arrived (the moment its answer begins, or returns). A request reads only what was
    readable when it arrived; the arrival is kept per handler thread."""

    def __init__(self, ready_s: float) -> None:
        self.ready_s = ready_s
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def arrived(self, when: float) -> None:
        self._local.arrived = when

    def hits(self, keys: list[str]) -> list[int]:
        """Indexes of the ``keys`` readable for this request; those not known yet are
        written (readable ``ready_s`` from now)."""
        arrived = getattr(self._local, "arrived", time.monotonic())
        with self._lock:
            hits = [i for i, key in enumerate(keys) if self._at.get(key, math.inf) <= arrived]
            for key in keys:
                self._at.setdefault(key, arrived + self.ready_s)
        return hits


class TimedOpenAITestServer(OpenAITestServer):
    """OpenAI's prompt caching (``prompt_cache=True``'s rule: 1,024 tokens or more, in
    128-token steps; a word is a token) where a prefix is readable only ``ready_s`` after
    the request that wrote it arrived (set it to the answer's latency: OpenAI's cache is
    there once the first answer is). Every answer takes ``latency_s``."""

    def __init__(self, *, latency_s: float = 0.2, ready_s: float | None = None) -> None:
        super().__init__(prompt_cache=True, handler=lambda body: Reply(delay_s=latency_s))
        self.readable = _Readable(latency_s if ready_s is None else ready_s)

    def _decide(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[Reply, float]:
        reply, arrived = super()._decide(path, body, headers)
        self.readable.arrived(arrived)
        return reply, arrived

    def _cached_tokens(self, body: Any) -> int:
        hits = self.readable.hits(_prefix_keys(body))
        return CACHE_MIN_TOKENS + CACHE_STEP_TOKENS * max(hits) if hits else 0


class TimedAnthropicTestServer(AnthropicTestServer):
    """Anthropic's prompt caching (``AnthropicTestServer``'s rule, with its
    ``min_cache_tokens``) where a marked prefix is readable only ``ready_s`` after the
    request that wrote it arrived (the moment its answer begins, as Anthropic documents;
    a streamed answer's ``message_start`` goes then). Every answer takes ``latency_s``."""

    def __init__(
        self, *, latency_s: float = 0.2, ready_s: float = 0.05, min_cache_tokens: int = 1024
    ) -> None:
        super().__init__(
            min_cache_tokens=min_cache_tokens,
            begins_s=ready_s,
            handler=lambda body: Reply(delay_s=latency_s),
        )
        self.readable = _Readable(ready_s)

    def _decide(self, path: str, body: Any, headers: Mapping[str, str]) -> tuple[Reply, float]:
        reply, arrived = super()._decide(path, body, headers)
        self.readable.arrived(arrived)
        return reply, arrived

    def _cached_ends(self, ends: list[int], keys: list[str]) -> list[int]:
        return [ends[i] for i in self.readable.hits(keys)]
