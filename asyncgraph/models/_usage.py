"""Running usage and cost totals of model calls."""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from asyncgraph.models._types import MAX_TOKENS, Completion

__all__ = ["Pricing", "Usage", "UsageMeter", "format_cost", "meters_for", "track_usage"]


@dataclass(frozen=True)
class Pricing:
    """Prices in US dollars per one million tokens, for ``Usage.cost_usd``.

    ``Pricing(input_usd_per_1m=0.15, output_usd_per_1m=0.60)`` prices prompt tokens at
    $0.15 and completion tokens at $0.60 per million. Prompt tokens the provider served
    from its prompt cache are priced at ``cached_input_usd_per_1m`` (OpenAI bills them
    at half the input price or less, Anthropic at a tenth), tokens it wrote to that cache
    at ``cache_write_usd_per_1m`` (Anthropic: 1.25 times the input price); either left
    ``None`` costs what an input token costs. A model without a ``Pricing`` has an
    unknown cost (``Usage.unpriced_requests``), except models built from a spec
    (``parse_model_spec``), which take the dated price table of ``asyncgraph.models``
    (``PRICES``, overridable through ``ASYNCGRAPH_MODEL_PRICES``) when it names them.

    Example::

        model = OpenAIChat("my-model", pricing=Pricing(input_usd_per_1m=0.15, output_usd_per_1m=0.60))
        print(Pricing(0.15, 0.60).cost_usd(1_000_000, 1_000_000))    # 0.75
    """

    input_usd_per_1m: float
    output_usd_per_1m: float
    cached_input_usd_per_1m: float | None = None
    cache_write_usd_per_1m: float | None = None

    def __post_init__(self) -> None:
        prices = (
            self.input_usd_per_1m,
            self.output_usd_per_1m,
            self.cached_input_usd_per_1m,
            self.cache_write_usd_per_1m,
        )
        if not all(p is None or p >= 0 for p in prices):  # also rejects NaN
            raise ValueError(f"prices must be >= 0, got {self!r}")

    def cost_usd(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float:
        """The cost of one answer; ``cache_read_tokens`` / ``cache_write_tokens`` are the
        part of ``prompt_tokens`` read from / written to the provider's prompt cache."""
        read = max(0, min(cache_read_tokens, prompt_tokens))
        write = max(0, min(cache_write_tokens, prompt_tokens - read))
        cached = self.input_usd_per_1m
        if self.cached_input_usd_per_1m is not None:
            cached = self.cached_input_usd_per_1m
        written = self.input_usd_per_1m
        if self.cache_write_usd_per_1m is not None:
            written = self.cache_write_usd_per_1m
        return (
            (prompt_tokens - read - write) * self.input_usd_per_1m
            + read * cached
            + write * written
            + completion_tokens * self.output_usd_per_1m
        ) / 1_000_000

    def completion_cost_usd(self, completion: Completion) -> float:
        """``cost_usd`` of ``completion``'s reported tokens (its prompt-cache share included)."""
        return self.cost_usd(
            completion.prompt_tokens,
            completion.completion_tokens,
            completion.cache_read_tokens,
            completion.cache_write_tokens,
        )


@dataclass(frozen=True)
class Usage:
    """A snapshot of usage totals.

    ``requests``: calls answered by the model (cache hits excluded; a call that needed
    retries counts once). ``cache_hits``: calls answered from the response cache, which
    cost nothing and add no tokens. ``prompt_tokens`` / ``completion_tokens``: tokens the
    model reported. ``cost_usd``: from the model's ``Pricing``, for the requests of
    priced models only. ``retries``: attempts repeated after a retryable failure.
    ``errors``: calls that raised in the end. ``unpriced_requests``: requests answered by
    a model without a ``Pricing``: their cost is unknown and not in ``cost_usd``, so
    show the total with ``format_cost``, never as a bare number.
    ``cache_read_tokens`` / ``cache_write_tokens``: the part of ``prompt_tokens`` the
    provider read from / wrote to its prompt cache (priced at ``Pricing``'s cached-input
    and cache-write rates; not to be confused with ``cache_hits``, the calls answered by
    asyncgraph's own response cache). ``replayed``: of the ``requests``, those a remote
    task's rerun took from its call journal instead of calling the model again (the
    worker that paid for them died before its reply; see NOTE [Call journal] in
    ``asyncgraph.models._journal``): the model billed them once, on the lost delivery,
    and their tokens and cost are counted here, once, since that delivery's reply never
    reached anyone. ``cut``: calls sent whose answer never came back (the caller was
    cancelled, the attempt timed out or lost its connection after sending): the provider
    may have billed them, so each is counted at an upper bound of what it can cost, in
    the tokens and in ``cost_usd`` (see NOTE [One meter] in ``asyncgraph.models._base``);
    ``upper_bound`` then says that ``cost_usd`` is one.

    Example::

        usage = model.usage.snapshot()      # a Usage
        print(usage.requests, usage.total_tokens, usage.cost_text)
    """

    requests: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    retries: int = 0
    errors: int = 0
    unpriced_requests: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    replayed: int = 0
    cut: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def upper_bound(self) -> bool:
        """True when calls were ``cut``: the tokens and ``cost_usd`` are then upper bounds."""
        return self.cut > 0

    @property
    def cost_text(self) -> str:
        """``cost_usd`` for people: ``"$0.0123"``, ``"$0.0123 + unknown"``, ``"cost unknown"``,
        ``"at most $0.0123"`` (an upper bound: calls were ``cut``)."""
        return format_cost(self.cost_usd, self.unpriced_requests, upper_bound=self.upper_bound)

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def to_dict(self) -> dict[str, int | float]:
        """A msgpack/JSON-ready map (what a worker sends back with a task's result).

        Holds the fields the distributed wire schema knows; ``unpriced_requests`` is
        not among them yet, so a worker's unpriced calls reach the client as priced at
        zero until the schema carries it (then drop this exclusion).
        """
        data: dict[str, int | float] = asdict(self)
        del data["unpriced_requests"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Usage:
        """Inverse of ``to_dict``; ``ValueError`` names a field out of range: ``cost_usd``
        must be a finite number >= 0, every count an int from 0 to ``MAX_TOKENS`` (a
        worker's report reaches the bill and the cost cap: a NaN cost would pass every
        ``> cap`` test, as the journal's ``Completion.from_dict`` refuses too)."""
        values: dict[str, int | float] = {}
        for f in fields(cls):
            value = data.get(f.name, 0)
            if f.name == "cost_usd":
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value < 0
                ):
                    raise ValueError(
                        f"usage field 'cost_usd' must be a finite number >= 0, got {value!r:.40}"
                    )
                values[f.name] = float(value)
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"usage field {f.name!r} must be an int, got {value!r:.40}")
            elif not 0 <= value <= MAX_TOKENS:
                raise ValueError(
                    f"usage field {f.name!r} must be from 0 to {MAX_TOKENS:,}, got {value!r:.40}"
                )
            else:
                values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]


class UsageMeter:
    """Thread-safe running totals; ``snapshot()`` returns a ``Usage``.

    Every model owns one (``model.usage``); pass the same ``UsageMeter`` to several
    models to add their usage together. ``in_flight`` counts the calls sent and not yet
    answered or cut; after ``stop_sending(reason)`` no call it counts is sent any more
    (each waits at its send until its caller cancels it), while those in flight finish
    and are counted (see NOTE [One meter] in ``asyncgraph.models._base``).

    Example::

        meter = UsageMeter()
        a = OpenAIChat("gpt-4o-mini", usage=meter)
        b = AnthropicChat("claude-sonnet-4-20250514", usage=meter)
        ...                                   # calls to a and b
        print(meter.snapshot().cost_text)     # both models' cost
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage = Usage()
        self._in_flight = 0
        self._stopped: str | None = None

    def snapshot(self) -> Usage:
        with self._lock:
            return self._usage

    @property
    def in_flight(self) -> int:
        """Calls counted here that were sent and are not answered or cut yet."""
        with self._lock:
            return self._in_flight

    @property
    def sending_stopped(self) -> str | None:
        """Why calls counted here may not be sent any more (``stop_sending``); None: they may."""
        return self._stopped

    def stop_sending(self, reason: str) -> None:
        """From now on, no call counted here is sent: each waits at its send until its
        caller is cancelled (at most ``SEND_HOLD_S``, then it raises ``ModelError`` saying
        ``reason``); the calls in flight go on, and are counted as they end."""
        with self._lock:
            if self._stopped is None:
                self._stopped = reason

    def call_sent(self) -> None:
        """A call counted here is being sent (``in_flight`` + 1); ``call_ended`` follows."""
        with self._lock:
            self._in_flight += 1

    def call_ended(self) -> None:
        """A call ``call_sent`` announced was answered or cut (and recorded)."""
        with self._lock:
            self._in_flight -= 1

    def reset(self) -> Usage:
        """Zero the totals and return what they were."""
        with self._lock:
            old, self._usage = self._usage, Usage()
            return old

    def record_completion(self, completion: Completion, pricing: Pricing | None) -> None:
        self._add_completion(completion, pricing, replayed=0)

    def record_replay(self, completion: Completion, pricing: Pricing | None) -> None:
        """A call answered from a task's call journal: billed once (on the delivery that
        died), counted once (here), marked ``replayed``."""
        self._add_completion(completion, pricing, replayed=1)

    def _add_completion(
        self, completion: Completion, pricing: Pricing | None, *, replayed: int
    ) -> None:
        self._add(
            Usage(
                requests=1,
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                cache_read_tokens=completion.cache_read_tokens,
                cache_write_tokens=completion.cache_write_tokens,
                cost_usd=pricing.completion_cost_usd(completion) if pricing is not None else 0.0,
                unpriced_requests=int(pricing is None),
                replayed=replayed,
            )
        )

    def record_cut(
        self, prompt_tokens: int, completion_tokens: int, pricing: Pricing | None
    ) -> None:
        """A call sent whose answer never came: counted as ``cut``, with ``prompt_tokens``
        and ``completion_tokens`` (upper bounds of what it could be billed) and their
        cost; a call of a model without a price is counted in ``unpriced_requests``."""
        cost = pricing.cost_usd(prompt_tokens, completion_tokens) if pricing is not None else 0.0
        self._add(
            Usage(
                cut=1,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cost_usd=cost,
                unpriced_requests=int(pricing is None),
            )
        )

    def add(self, usage: Usage) -> None:
        """Add a whole ``Usage`` (e.g. what a worker reported for a remote task)."""
        self._add(usage)

    def _add(self, usage: Usage) -> None:
        """Every count goes in here: a ``record_*`` adds the ``Usage`` of its one event
        (not through ``add``, which a subclass may watch for whole reports)."""
        with self._lock:
            self._usage = self._usage + usage

    def record_cache_hit(self) -> None:
        self._add(Usage(cache_hits=1))

    def record_retry(self) -> None:
        self._add(Usage(retries=1))

    def record_error(self) -> None:
        self._add(Usage(errors=1))

    def __repr__(self) -> str:
        return f"UsageMeter({self.snapshot()!r})"


def format_cost(cost_usd: float, unpriced_requests: int = 0, *, upper_bound: bool = False) -> str:
    """A cost for people: unknown prices are said, never shown as ``$0.0000``.

    ``"$0"`` (nothing spent, every call priced: e.g. the free simulated model),
    ``"$0.0123"`` (``"$12.35"`` from one dollar), ``"$0.0123 + unknown"`` (some calls
    came from models without a price), ``"cost unknown"`` (none had one); ``upper_bound``
    (calls were cut before their answer, ``Usage.cut``) says ``"at most $0.0123"``.

    Example::

        print(format_cost(0.0123))          # $0.0123
        print(format_cost(0.0123, 2))       # $0.0123 + unknown
        print(format_cost(0.0, 3))          # cost unknown
        print(format_cost(0.0123, upper_bound=True))   # at most $0.0123
    """
    if cost_usd == 0:
        known = "$0"
    elif cost_usd < 1:
        known = f"${cost_usd:.4f}"
    else:
        known = f"${cost_usd:,.2f}"
    if upper_bound and cost_usd > 0:
        known = f"at most {known}"
    if unpriced_requests <= 0:
        return known
    return "cost unknown" if cost_usd == 0 else f"{known} + unknown"


_SINKS: contextvars.ContextVar[tuple[UsageMeter, ...]] = contextvars.ContextVar(
    "asyncgraph_usage_sinks", default=()
)


@contextmanager
def track_usage(meter: UsageMeter | None = None) -> Iterator[UsageMeter]:
    """Count every model call made inside the block, in this task and the tasks it starts.

    Yields a ``UsageMeter`` (a new one, or ``meter``) that receives the usage of
    every ``BaseChatModel`` call made in this context, whichever model made it, and
    the usage that workers report for remote nodes of a backward run here (the
    Redis executor adds it), so a job counts the same tokens and cost whether its
    backward runs in-process or on a fleet::

        with track_usage() as usage:
            await loss.backward(executor=ex)
        print(usage.snapshot().total_tokens)

    Blocks nest: an inner block's calls count in the outer one too.
    """
    meter = meter if meter is not None else UsageMeter()
    token = _SINKS.set((*_SINKS.get(), meter))
    try:
        yield meter
    finally:
        _SINKS.reset(token)


def meters_for(own: UsageMeter | None = None) -> tuple[UsageMeter, ...]:
    """``own`` plus the meters of the enclosing ``track_usage`` blocks (each once)."""
    sinks = _SINKS.get()
    if own is None:
        return sinks
    return (own, *(m for m in sinks if m is not own))
