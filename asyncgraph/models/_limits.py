"""What a model can take: its context window, its concurrency, the size of a reply.

A model's limits come, first match wins, from what the user gave (``context_tokens=``,
``max_concurrency=``, ``max_tokens=`` on the model), from the server where it says
(``HttpChatModel._discover``: llama.cpp's ``/props``, vLLM's ``/v1/models``), and, for
the context window, from the dated table of hosted models (``_prices.CONTEXT_WINDOWS``).
Unknown limits stay None: nothing is sized to them.

- **The reply's size.** A request that gives no ``max_tokens`` (per call, in the
  model's ``default_params``, or the model's ``max_tokens=``) asks for the size that the
  code sending it suggested for what it asks (``reply_tokens``: an answer, a verdict,
  feedback, an update), cut to the room the context window leaves.
- **Counting tokens before sending.** ``TokenEstimator`` counts a request's tokens from
  its characters, at a conservative 3 characters per token until the server's usage
  shows the model's own ratio (the lowest ratio of recent answers, so a count errs
  high); a context refusal teaches it the server's exact count.
- **Context refusals.** ``context_refusal`` reads llama.cpp's ``exceed_context_size_error``
  and vLLM's "maximum context length" errors into a ``ModelContextError``.

See NOTE [Requests a server can serve] in ``asyncgraph.models._base``.
"""

from __future__ import annotations

import contextvars
import math
import re
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MIN_REPLY_TOKENS",
    "ModelLimits",
    "TokenEstimator",
    "context_refusal",
    "current_reply_tokens",
    "reply_tokens",
]

MIN_REPLY_TOKENS = 16
"""The least room for a reply a request is sent with; less is a ``ModelContextError``."""

# Tokens a chat template adds: per message (role markers) and per request (the
# assistant's turn), counted generously.
_PER_MESSAGE = 8
_PER_REQUEST = 16
_START_CHARS_PER_TOKEN = 3.0
_LOWEST_CHARS_PER_TOKEN = 1.0
_OBSERVED = 32  # answers whose ratio is remembered

_suggested: contextvars.ContextVar[tuple[int, bool] | None] = contextvars.ContextVar(
    "asyncgraph_reply_tokens", default=None
)
SHARE_OF_WINDOW = 8
"""A suggested reply takes at most 1/8 of a known context window (unless ``whole``): the
requests that quote it later (a judge's, a feedback request) must still fit."""


@contextmanager
def reply_tokens(
    tokens: int | None, *, replace: bool = True, whole: bool = False
) -> Iterator[None]:
    """Within the block (this task and the tasks it starts), a model call that gives no
    ``max_tokens`` (nor its model) asks for at most ``tokens``, and at most an eighth of
    the model's context window when it is known, unless ``whole`` (a reply that is useless
    cut: an optimizer's new value). ``replace=False`` keeps a suggestion already in
    effect (an outer, more specific one: a judge's verdict around the answer call it
    makes).

    Example::

        with reply_tokens(256):
            verdict = await model.complete(messages)     # sent with max_tokens=256
    """
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
        raise TypeError(f"reply_tokens: tokens must be an int or None, got {tokens!r}")
    if not replace and _suggested.get() is not None:
        yield
        return
    token = _suggested.set(None if tokens is None else (max(1, tokens), whole))
    try:
        yield
    finally:
        _suggested.reset(token)


def current_reply_tokens(context_tokens: int | None = None) -> int | None:
    """The reply size suggested here (``reply_tokens``), or None; with a model's
    ``context_tokens``, at most its share of it (``SHARE_OF_WINDOW``) unless ``whole``."""
    suggested = _suggested.get()
    if suggested is None:
        return None
    tokens, whole = suggested
    return reply_share(tokens, context_tokens, whole=whole)


def reply_share(tokens: int, context_tokens: int | None, *, whole: bool = False) -> int:
    """The ``max_tokens`` a suggested reply of ``tokens`` is sent with: at most its share
    of a known window (``SHARE_OF_WINDOW``, at least 64), unless ``whole``. What a request
    keeps room for is computed with this too (``asyncgraph.text._fit``)."""
    if context_tokens is None or whole:
        return tokens
    return min(tokens, max(64, context_tokens // SHARE_OF_WINDOW))


def content_chars(content: Any) -> int:
    """Characters of a message's content: its text, or its text parts' (an image part
    counts as 1,000 characters; its real cost depends on the provider)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"])
            else:
                total += 1000
        return total
    return len(str(content))


def request_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(content_chars(m.get("content", "")) for m in messages)


class TokenEstimator:
    """Counts a request's tokens before it is sent, erring high (see the module docstring).

    ``chars_per_token`` is the ratio in use: 3.0 at first, then the lowest of the last
    answers' ``characters / prompt tokens`` (``observe``). Thread-safe.

    Example::

        estimator = TokenEstimator()
        estimator.count([{"role": "user", "content": "x" * 300}])    # 100 + 24
        estimator.observe(chars=4000, messages=2, prompt_tokens=1000)
        estimator.chars_per_token                                      # 4.0
    """

    def __init__(self, chars_per_token: float = _START_CHARS_PER_TOKEN) -> None:
        self._start = chars_per_token
        self._ratios: deque[float] = deque(maxlen=_OBSERVED)
        self._lock = threading.Lock()

    @property
    def chars_per_token(self) -> float:
        with self._lock:
            return min(self._ratios) if self._ratios else self._start

    def tokens(self, text: str) -> int:
        """Tokens of ``text`` alone (no template overhead)."""
        return math.ceil(len(text) / self.chars_per_token)

    def count(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """Tokens of a request's messages, template overhead included."""
        chars = request_chars(messages)
        return math.ceil(chars / self.chars_per_token) + _PER_MESSAGE * len(messages) + _PER_REQUEST

    def observe(self, *, chars: int, messages: int, prompt_tokens: int) -> None:
        """Learn from a server's count: ``prompt_tokens`` for ``chars`` characters in
        ``messages`` messages (too small a request to say anything is ignored)."""
        # The template's tokens are counted as text here (the server's overhead is not
        # known): a lower ratio, so counts err high.
        if chars < 400 or prompt_tokens < 64:
            return
        ratio = max(_LOWEST_CHARS_PER_TOKEN, chars / prompt_tokens)
        with self._lock:
            self._ratios.append(ratio)

    def exact(self, *, chars: int, messages: int, prompt_tokens: int) -> None:
        """A server's exact count of a request it refused: the ratio is at most this one."""
        ratio = max(_LOWEST_CHARS_PER_TOKEN, chars / max(1, prompt_tokens))
        with self._lock:
            self._ratios.append(ratio * 0.95)


@dataclass(frozen=True)
class ModelLimits:
    """A model's limits as known now (None: unknown).

    ``context_tokens``: the window one request (prompt and reply) must fit, per slot on a
    server that splits its context between slots; ``max_concurrency``: requests sent at
    once; ``max_tokens``: the model's own reply size (wins over suggestions);
    ``chars_per_token``: the estimator's ratio, to size texts in the model's tokens;
    ``source``: where the context window came from (``"given"``, ``"server"``,
    ``"table"``).
    """

    context_tokens: int | None = None
    max_concurrency: int | None = None
    max_tokens: int | None = None
    chars_per_token: float = _START_CHARS_PER_TOKEN
    source: str = ""

    def tokens(self, text: str) -> int:
        """``text``'s size in this model's tokens (erring high)."""
        return math.ceil(len(text) / self.chars_per_token)

    def count(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """A request's size in this model's tokens, template overhead included (as
        ``TokenEstimator.count``)."""
        chars = request_chars(messages)
        return math.ceil(chars / self.chars_per_token) + _PER_MESSAGE * len(messages) + _PER_REQUEST

    def reply_tokens(self, suggested: int, *, whole: bool = False) -> int:
        """The ``max_tokens`` a request whose asking code suggests a reply of
        ``suggested`` tokens is sent with: the model's own ``max_tokens`` when it has one,
        else the suggestion within its share of the window (``reply_share``)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return reply_share(suggested, self.context_tokens, whole=whole)


# vLLM: "This model's maximum context length is 2048 tokens. However, you requested 2100
# tokens (2000 in the messages, 100 in the completion)." and the newer "... and your
# prompt contains at least 2049 input tokens" / "your request has 1500 input tokens".
_VLLM_CONTEXT = re.compile(r"maximum context length is (\d+) tokens", re.IGNORECASE)
_VLLM_PROMPT = re.compile(
    r"(\d+) in the messages|contains at least (\d+) input tokens|has (\d+) input tokens",
    re.IGNORECASE,
)


def context_refusal(data: Any, message: str) -> tuple[int | None, int | None] | None:
    """``(prompt_tokens, context_tokens)`` when an error body ``data`` (with its
    ``message``) is a context-window refusal, else None.

    llama.cpp's: ``{"error": {"code": 400, "message": "request (2062 tokens) exceeds the
    available context size (2048 tokens), try increasing it", "type":
    "exceed_context_size_error", "n_prompt_tokens": 2062, "n_ctx": 2048}}``; vLLM's: its
    "maximum context length is N tokens" message.
    """
    error = data.get("error") if isinstance(data, Mapping) else None
    if isinstance(error, Mapping) and error.get("type") == "exceed_context_size_error":
        prompt, ctx = error.get("n_prompt_tokens"), error.get("n_ctx")
        return (
            prompt if isinstance(prompt, int) else None,
            ctx if isinstance(ctx, int) else None,
        )
    match = _VLLM_CONTEXT.search(message)
    if match is None:
        return None
    prompt_match = _VLLM_PROMPT.search(message)
    prompt = None
    if prompt_match is not None:
        prompt = int(next(g for g in prompt_match.groups() if g is not None))
    return prompt, int(match.group(1))
