"""Running usage and cost totals of model calls."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from asyncgraph.models._types import Completion

__all__ = ["Pricing", "Usage", "UsageMeter"]


@dataclass(frozen=True)
class Pricing:
    """Prices in US dollars per one million tokens, for ``Usage.cost_usd``.

    ``Pricing(input_usd_per_1m=0.15, output_usd_per_1m=0.60)`` prices prompt tokens at
    $0.15 and completion tokens at $0.60 per million. Check your provider's price list:
    asyncgraph ships no prices.
    """

    input_usd_per_1m: float
    output_usd_per_1m: float

    def __post_init__(self) -> None:
        if self.input_usd_per_1m < 0 or self.output_usd_per_1m < 0:
            raise ValueError(f"prices must be >= 0, got {self!r}")

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (
            prompt_tokens * self.input_usd_per_1m + completion_tokens * self.output_usd_per_1m
        ) / 1_000_000


@dataclass(frozen=True)
class Usage:
    """A snapshot of usage totals.

    ``requests``: calls answered by the model (cache hits excluded; a call that needed
    retries counts once). ``cache_hits``: calls answered from the response cache, which
    cost nothing and add no tokens. ``prompt_tokens`` / ``completion_tokens``: tokens the
    model reported. ``cost_usd``: from the model's ``Pricing`` (0.0 without one).
    ``retries``: attempts repeated after a retryable failure. ``errors``: calls that
    raised in the end.
    """

    requests: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    retries: int = 0
    errors: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageMeter:
    """Thread-safe running totals; ``snapshot()`` returns a ``Usage``.

    Every model owns one (``model.usage``); pass the same ``UsageMeter`` to several
    models to add their usage together.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage = Usage()

    def snapshot(self) -> Usage:
        with self._lock:
            return self._usage

    def reset(self) -> Usage:
        """Zero the totals and return what they were."""
        with self._lock:
            old, self._usage = self._usage, Usage()
            return old

    def record_completion(self, completion: Completion, pricing: Pricing | None) -> None:
        p, c = completion.prompt_tokens, completion.completion_tokens
        cost = pricing.cost_usd(p, c) if pricing is not None else 0.0
        with self._lock:
            u = self._usage
            self._usage = replace(
                u,
                requests=u.requests + 1,
                prompt_tokens=u.prompt_tokens + p,
                completion_tokens=u.completion_tokens + c,
                cost_usd=u.cost_usd + cost,
            )

    def record_cache_hit(self) -> None:
        with self._lock:
            self._usage = replace(self._usage, cache_hits=self._usage.cache_hits + 1)

    def record_retry(self) -> None:
        with self._lock:
            self._usage = replace(self._usage, retries=self._usage.retries + 1)

    def record_error(self) -> None:
        with self._lock:
            self._usage = replace(self._usage, errors=self._usage.errors + 1)

    def __repr__(self) -> str:
        return f"UsageMeter({self.snapshot()!r})"
