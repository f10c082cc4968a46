"""The model contract: ``ChatModel``, ``Completion`` and the message shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ChatModel", "Completion", "Message", "normalize_messages"]

MAX_TOKENS = 100_000_000
"""The most tokens one call may count in a field of a stored ``Completion`` (a cached or
journaled answer): far above any model's context window, far below a forged bill."""

Message = Mapping[str, Any]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


@dataclass(frozen=True)
class Completion:
    """The answer of one chat completion.

    ``text`` is the reply, ``model`` the name of the model that produced it (``"simulated"``
    for ``SimulatedModel``), ``prompt_tokens`` / ``completion_tokens`` the usage the server
    reported. ``cached`` is true when the answer came from a response cache, not the model.
    ``cache_read_tokens`` / ``cache_write_tokens`` are the part of ``prompt_tokens`` the
    provider read from / wrote to its *prompt* cache (OpenAI's
    ``prompt_tokens_details.cached_tokens``; Anthropic's ``cache_read_input_tokens`` /
    ``cache_creation_input_tokens``), which ``Pricing`` bills at their own rates; 0 when
    the provider reported none. ``prompt_tokens`` counts every input token, these included.

    Example::

        answer = await model.complete([{"role": "user", "content": "Hi"}])
        print(answer.text, answer.model, answer.total_tokens, answer.cached)
    """

    text: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    cached: bool = False
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what the caches store; never pickle)."""
        return {
            "text": self.text,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Completion:
        """Inverse of ``to_dict``; raises ``ValueError`` if a field is missing or mistyped,
        or a token count is not an integer from 0 to ``MAX_TOKENS`` (a stored answer is read
        back from Redis: its counts reach the bill and the cost cap)."""
        text, model = data.get("text"), data.get("model")
        prompt, completion = data.get("prompt_tokens", 0), data.get("completion_tokens", 0)
        finish = data.get("finish_reason")
        # Absent in answers cached before prompt-cache accounting existed: none then.
        read, write = data.get("cache_read_tokens", 0), data.get("cache_write_tokens", 0)
        if not isinstance(text, str) or not isinstance(model, str):
            raise ValueError(f"completion needs str 'text' and 'model', got {dict(data)!r}")
        counts = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cache_read_tokens": read,
            "cache_write_tokens": write,
        }
        for name, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int):
                raise ValueError(f"completion token count {name!r} must be an int, got {n!r:.40}")
            if not 0 <= n <= MAX_TOKENS:
                raise ValueError(
                    f"completion token count {name!r} must be from 0 to {MAX_TOKENS:,}, got {n!r}"
                )
        if finish is not None and not isinstance(finish, str):
            raise ValueError(f"completion finish_reason must be str or None, got {finish!r}")
        return cls(
            text,
            model,
            prompt,
            completion,
            finish,
            cache_read_tokens=read,
            cache_write_tokens=write,
        )


@runtime_checkable
class ChatModel(Protocol):
    """Anything that answers chat messages.

    ``await model.complete(messages, **params)`` sends ``messages`` (a list of
    ``{"role": ..., "content": ...}`` dicts) with provider parameters such as
    ``temperature`` or ``max_tokens`` and returns a ``Completion``. Failures raise a
    ``ModelError`` subclass. Implementations must work under asyncio and trio.

    Example of a third implementation::

        class Upper:
            async def complete(self, messages, **params):
                return Completion(messages[-1]["content"].upper(), model="upper")
    """

    async def complete(self, messages: Sequence[Message], **params: Any) -> Completion: ...


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copy ``messages`` into plain dicts, checking each has a str ``role`` and a ``content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r}"
        )
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "content" not in message:
            raise TypeError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got {message!r}"
            )
        if not isinstance(message.get("role"), str):
            raise TypeError(f"messages[{i}]['role'] must be a str, got {message.get('role')!r}")
        out.append(dict(message))
    if not out:
        raise ValueError("messages is empty: send at least one {'role': 'user', 'content': ...}")
    return out
