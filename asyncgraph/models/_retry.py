"""Retry policy: exponential backoff with jitter, honouring Retry-After."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Retry", "parse_retry_after"]


@dataclass(frozen=True)
class Retry:
    """How a model retries a call that failed with a retryable ``ModelError``.

    Retryable failures are HTTP 429 and 5xx, connection errors and timeouts. Attempt
    ``n`` (1-based) that failed waits ``backoff_s(n)`` before attempt ``n + 1``: a delay
    drawn uniformly from ``[d/2, d]`` with ``d = min(backoff_max_s, backoff_base_s *
    2 ** (n - 1))`` ("equal jitter", so processes that failed together do not retry
    together). When the server sent ``Retry-After`` (seconds; or ``retry-after-ms``),
    the wait is that value instead, capped at ``retry_after_max_s``. After
    ``max_attempts`` attempts the call raises ``ModelRetryError`` chaining the last
    error. ``Retry(max_attempts=1)`` disables retries.
    """

    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 20.0
    retry_after_max_s: float = 60.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0 or self.retry_after_max_s < 0:
            raise ValueError(f"backoff and retry-after bounds must be >= 0, got {self!r}")

    def backoff_s(self, failed_attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed."""
        if retry_after_s is not None and retry_after_s >= 0:
            return min(retry_after_s, self.retry_after_max_s)
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** (failed_attempt - 1))
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the server asks us to wait, from ``retry-after-ms`` or ``Retry-After``.

    Only the delta-seconds form of ``Retry-After`` is understood; an HTTP date or garbage
    gives ``None`` (the normal backoff is used then). ``headers`` lookups must be
    case-insensitive (``httpx.Headers`` is).
    """
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value.strip()) / scale
        except ValueError:
            continue
        if seconds >= 0 and seconds == seconds and seconds != float("inf"):
            return seconds
    return None
