"""Retry policy: exponential backoff with jitter, honouring Retry-After."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = ["Retry", "parse_retry_after"]


@dataclass(frozen=True)
class Retry:
    """How a model retries a call that failed with a retryable ``ModelError``.

    Retryable failures are HTTP 408, 429 and 5xx, connection errors and timeouts. Attempt
    ``n`` (1-based) that failed waits ``backoff_s(n)`` before attempt ``n + 1``: a delay
    drawn uniformly from ``[d/2, d]`` with ``d = min(backoff_max_s, backoff_base_s *
    2 ** (n - 1))`` ("equal jitter", so processes that failed together do not retry
    together). When the server sent ``Retry-After`` (seconds or an HTTP date; or
    ``retry-after-ms``), the wait is that value instead, capped at ``retry_after_max_s``,
    plus a random extra of up to ``retry_after_jitter`` of it (0.2 = up to 20% more), so
    callers that got the same 429 at the same moment do not all come back in the same
    instant. A timeout is not a refusal: the server may still be working on the request, so
    its retry backs off from ``timeout_backoff_s`` (default: 4x ``backoff_base_s``)
    instead, and waits it out holding the request's place among the model's
    ``max_concurrency`` (see NOTE [Requests a server can serve] in
    ``asyncgraph.models._base``). After ``max_attempts`` attempts the call raises
    ``ModelRetryError`` chaining the last error. ``Retry(max_attempts=1)`` disables retries. ``rng`` draws the
    jitter (pass ``random.Random(seed)`` for reproducible delays).

    Example::

        model = OpenAIChat("gpt-4o-mini", retry=Retry(max_attempts=6, backoff_max_s=30))
        print(Retry(rng=random.Random(0)).backoff_s(1))     # between 0.25 and 0.5
    """

    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 20.0
    retry_after_max_s: float = 60.0
    retry_after_jitter: float = 0.2
    timeout_backoff_s: float | None = None
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts must be an int, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        bounds = (
            self.backoff_base_s,
            self.backoff_max_s,
            self.retry_after_max_s,
            self.retry_after_jitter,
            self.timeout_backoff_s if self.timeout_backoff_s is not None else 0.0,
        )
        if not all(b >= 0 for b in bounds):  # also rejects NaN
            raise ValueError(f"backoff, retry-after and jitter bounds must be >= 0, got {self!r}")

    def backoff_s(
        self, failed_attempt: int, retry_after_s: float | None = None, *, timed_out: bool = False
    ) -> float:
        """Seconds to wait after attempt number ``failed_attempt`` (1-based) failed
        (``timed_out``: it got no answer in time, rather than a refusal)."""
        if retry_after_s is not None and retry_after_s >= 0:
            wait = min(retry_after_s, self.retry_after_max_s)
            return wait + self.rng.uniform(0, wait * self.retry_after_jitter)
        base = self.backoff_base_s
        if timed_out:
            base = self.timeout_backoff_s if self.timeout_backoff_s is not None else 4 * base
        ceiling = min(self.backoff_max_s, base * 2.0 ** (failed_attempt - 1))
        return ceiling / 2 + self.rng.uniform(0, ceiling / 2)


def parse_retry_after(headers: Mapping[str, str], now: datetime | None = None) -> float | None:
    """Seconds the server asks us to wait, from ``retry-after-ms`` or ``Retry-After``.

    ``Retry-After`` may be delta-seconds (``"120"``) or an HTTP date (``"Wed, 21 Oct 2015
    07:28:00 GMT"``), read relative to ``now`` (default: the current time; a naive ``now``
    is taken as UTC); a date in the past means "now" (0). Garbage gives ``None`` (the
    normal backoff is used then). ``headers`` lookups must be case-insensitive
    (``httpx.Headers`` is).
    """
    ms = _seconds(headers.get("retry-after-ms"), scale=1000.0)
    if ms is not None:
        return ms
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _seconds(value, scale=1.0)
    if seconds is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" dates are naive; HTTP dates are always GMT
        when = when.replace(tzinfo=UTC)
    if now is None:
        now = datetime.now(UTC)
    elif now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return max(0.0, (when - now).total_seconds())


def _seconds(value: str | None, *, scale: float) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value.strip()) / scale
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
