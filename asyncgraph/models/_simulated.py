"""``SimulatedModel``: an offline, deterministic stand-in for an LLM, for demos and tests."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._cache import Cache
from asyncgraph.models._ratelimit import RateLimit, RateLimiter
from asyncgraph.models._retry import Retry
from asyncgraph.models._types import Completion
from asyncgraph.models._usage import Pricing, UsageMeter

__all__ = ["SIMULATED_MODEL_NAME", "SIMULATED_TAG", "SimulatedModel", "simulated_reply"]

SIMULATED_MODEL_NAME = "simulated"
SIMULATED_TAG = "[simulated]"

Responder = Callable[[list[dict[str, Any]]], str | Awaitable[str]]

# Edits the simulated optimizer appends, one per step, each visibly marked as simulated.
_EDITS = (
    "[simulated edit] State the final answer on its own line.",
    "[simulated edit] Be concise: drop filler words.",
    "[simulated edit] Check each step before answering.",
    "[simulated edit] Name the assumptions you make.",
    "[simulated edit] Use the exact terms of the question.",
    "[simulated edit] Give one concrete example.",
)

_FEEDBACK = (
    "state the final answer explicitly; the reader has to infer it.",
    "it is longer than it needs to be; cut the repetition.",
    "one step is asserted without justification; show the check.",
    "it leaves an assumption implicit; name it.",
    "it drifts from the question's wording; reuse its terms.",
    "it stays abstract; one concrete example would help.",
)

_FEEDBACK_WORDS = re.compile(
    r"\b(feedback|critique|criticism|criticize|criticise|evaluate|evaluation|gradient|"
    r"improve|improvement)\b",
    re.IGNORECASE,
)
_VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)


def _digest(messages: Sequence[Mapping[str, Any]]) -> int:
    text = json.dumps(list(messages), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _snippet(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def content_text(content: Any) -> str:
    """A message's content as text: a string as is; OpenAI content parts joined, an image
    part read as ``[image]`` (so the simulated model answers image requests offline)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", "")) if part.get("type") == "text" else "[image]"
            for part in content
            if isinstance(part, Mapping)
        )
    return str(content)


def simulated_reply(messages: Sequence[Mapping[str, Any]]) -> str:
    """The built-in simulated reply to ``messages`` (deterministic, untagged).

    Three behaviours, picked from the text of all messages:

    - it mentions ``IMPROVED_VARIABLE`` (an optimizer step): the reply holds
      ``<IMPROVED_VARIABLE>...</IMPROVED_VARIABLE>`` with the text found between
      ``<VARIABLE>`` tags (last occurrence) plus one ``[simulated edit] ...`` line it did
      not contain yet (unchanged once all edits are present);
    - it mentions feedback / critique / evaluate / gradient / improve: one line of
      generic feedback quoting the start of the text under review;
    - otherwise: an acknowledgement quoting the last message.

    Which edit or feedback line is chosen depends on a sha256 of the messages.
    """
    everything = "\n".join(content_text(m.get("content", "")) for m in messages)
    last = content_text(messages[-1].get("content", "")) if messages else ""
    seed = _digest(messages)
    variables = _VARIABLE.findall(everything)
    target = variables[-1].strip() if variables else last
    if "IMPROVED_VARIABLE" in everything:
        edit = next(
            (
                _EDITS[(seed + i) % len(_EDITS)]
                for i in range(len(_EDITS))
                if _EDITS[(seed + i) % len(_EDITS)] not in target
            ),
            None,
        )
        improved = target if edit is None else f"{target}\n{edit}".strip()
        return f"Revised text:\n<IMPROVED_VARIABLE>{improved}</IMPROVED_VARIABLE>"
    if _FEEDBACK_WORDS.search(everything):
        return f"Feedback on {_snippet(target)!r}: {_FEEDBACK[seed % len(_FEEDBACK)]}"
    return f"Reply #{seed % 10_000:04d} to {_snippet(last)!r}."


class SimulatedModel(BaseChatModel):
    """A deterministic stand-in for an LLM that runs offline. It is not a language model.

    Every answer says so: ``Completion.model`` is ``"simulated"`` (always, whatever the
    options) and by default the text starts with ``"[simulated] "``. ``tag_replies=False``
    drops that text prefix; it is meant for scripted replies (a ``responder``) that must
    parse exactly, e.g. an optimizer's ``<IMPROVED_VARIABLE>`` answer in a test; the model
    name still says simulated. The same messages always give the same reply. Each call
    sleeps ``latency_s`` (default 0.1 s) to stand in for network time, so concurrency is
    visible in demos. Token counts are whitespace-separated words, not real tokens. A
    simulated call costs nothing by definition: ``pricing`` defaults to ``Pricing(0, 0)``
    (its cost shows as ``$0``, never "unknown").

    Without a ``responder`` the replies come from ``simulated_reply`` (feedback when asked
    for feedback, ``<IMPROVED_VARIABLE>`` tags when asked to improve a variable). A
    ``responder(messages) -> str`` (or an async one) scripts the replies instead; it may
    raise a ``ModelError`` (e.g. ``ModelServerError``) to exercise the retry middleware.
    Cache, rate limit, retries and usage work as for every ``BaseChatModel``; the cache
    key includes the responder's qualified name and ``tag_replies``::

        model = SimulatedModel(latency_s=0.0, responder=lambda messages: "42")
        (await model.complete([{"role": "user", "content": "6 * 7?"}])).text
        # '[simulated] 42'
    """

    request_params = None  # it sends nothing anywhere (see NOTE [Outbound policy])

    def __init__(
        self,
        *,
        latency_s: float = 0.1,
        responder: Responder | None = None,
        tag_replies: bool = True,
        retry: Retry | None = None,
        rate_limit: RateLimit | RateLimiter | None = None,
        cache: Cache | None = None,
        pricing: Pricing | None = None,
        usage: UsageMeter | None = None,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
        super().__init__(
            SIMULATED_MODEL_NAME,
            retry=retry,
            rate_limit=rate_limit,
            cache=cache,
            pricing=pricing if pricing is not None else Pricing(0.0, 0.0),
            usage=usage,
        )
        self.latency_s = latency_s
        self.responder = responder
        self.tag_replies = tag_replies

    @property
    def cache_endpoint(self) -> str:
        if self.responder is None:
            return "simulated:builtin"
        fn = self.responder
        return f"simulated:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def cache_request(
        self, messages: list[dict[str, Any]], params: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The default request plus ``tag_replies``, which changes every reply's text."""
        return {**super().cache_request(messages, params), "tag_replies": self.tag_replies}

    async def _complete_once(
        self, messages: list[dict[str, Any]], params: dict[str, Any]
    ) -> Completion:
        if self.latency_s > 0:
            await anyio.sleep(self.latency_s)
        if self.responder is None:
            text = simulated_reply(messages)
        else:
            result = self.responder(messages)
            text = await result if inspect.isawaitable(result) else result
            if not isinstance(text, str):
                raise TypeError(f"SimulatedModel responder must return str, got {text!r}")
        if self.tag_replies:
            text = f"{SIMULATED_TAG} {text}"
        prompt = sum(len(content_text(m.get("content", "")).split()) for m in messages)
        return Completion(
            text=text,
            model=SIMULATED_MODEL_NAME,
            prompt_tokens=prompt,
            completion_tokens=len(text.split()),
            finish_reason="stop",
        )

    def __repr__(self) -> str:
        return (
            f"SimulatedModel(latency_s={self.latency_s!r}, responder={self.responder!r}, "
            f"tag_replies={self.tag_replies!r})"
        )
