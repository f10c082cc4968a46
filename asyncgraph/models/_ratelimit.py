"""Rate limits in requests and tokens per minute, in-process or shared through Redis.

Both limiters implement GCRA (the generic cell rate algorithm) as *reservations*: a
caller asks for a slot, the limiter answers at once with the time the slot starts and
books it, and the caller sleeps until then. There is no polling and no busy-spin, slots
are handed out first come first served, and with Redis one atomic Lua script books the
slot for every process of the fleet against Redis's own clock.

Why the pace is slightly below the limit: a provider counts requests at *arrival* in a
sliding window (e.g. at most 600 in any 60 s). Requests reach it with some jitter after
their slot, and a burst adds requests on top of the steady pace. With ``N`` requests per
``window_s``, ``burst_requests = B`` and a jitter allowance ``margin_s = J``, the slots are
spaced ``T = (window_s + J) / (N - B + 1)`` apart, which admits at most ``N`` slots in any
``window_s + J`` span, so at most ``N`` arrivals in any window as long as the jitter stays
below ``J``. For 600/min, ``B = 1``, ``J = 0.5 s`` that is 99.2% of the limit.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import anyio

from asyncgraph._exceptions import RateLimitWaitError
from asyncgraph._redact import redact_url
from asyncgraph.models._keys import rate_limit_keys, rate_limit_once_key
from asyncgraph.models._redis import RedisHandle, Script

__all__ = [
    "LocalRateLimiter",
    "RateLimit",
    "RateLimiter",
    "RedisRateLimiter",
    "gcra_reserve",
    "make_rate_limiter",
]


@dataclass(frozen=True)
class RateLimit:
    """A budget of requests and/or tokens per minute; pass it as a model's ``rate_limit``.

    ``requests_per_minute`` / ``tokens_per_minute``: the provider's limits (``None`` = no
    limit of that kind; give at least one). ``window_s``: the length of the sliding window
    the provider counts over (60 s for per-minute limits); the limiter guarantees at most
    ``requests_per_minute * window_s / 60`` request starts in any ``window_s``.
    ``burst_requests``: how many requests may start back to back after an idle spell
    (1 = evenly paced; a bigger burst lowers the steady pace to keep the guarantee).
    ``margin_s``: the arrival jitter (network, scheduling) the guarantee allows for.
    ``max_wait_s``: a call that would wait longer for its slot raises
    ``RateLimitWaitError`` instead of booking it.

    ``redis_url``: when given, the budget is shared by every process using the same
    ``redis_url`` and ``name`` (default: the model's name), enforced atomically in Redis;
    each Redis call times out after ``redis_timeout_s``. Without it the budget is
    in-process, one per model; to share one between several models of a process pass
    them the same ``LocalRateLimiter(limit)``.

    Tokens are booked before the call from an estimate (prompt length / 4 plus
    ``max_tokens``) and corrected with the usage the server reports; requests are exact.

    Example::

        model = OpenAIChat(
            "gpt-4o-mini", rate_limit=RateLimit(requests_per_minute=500, tokens_per_minute=200_000)
        )
        print(RateLimit(requests_per_minute=60).describe())    # 60 requests/min
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    window_s: float = 60.0
    burst_requests: int = 1
    margin_s: float = 0.5
    max_wait_s: float = 300.0
    redis_url: str | None = None
    name: str | None = None
    redis_timeout_s: float = 5.0

    def __repr__(self) -> str:
        # Shown in errors: the Redis URL's password redacted.
        fields = {**vars(self), "redis_url": self.redis_url and redact_url(self.redis_url)}
        return f"RateLimit({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def __post_init__(self) -> None:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ValueError("RateLimit needs requests_per_minute and/or tokens_per_minute")
        if self.window_s <= 0 or self.margin_s < 0 or self.max_wait_s < 0:
            raise ValueError(
                f"RateLimit needs window_s > 0, margin_s >= 0, max_wait_s >= 0, got {self!r}"
            )
        if self.burst_requests < 1:
            raise ValueError(f"burst_requests must be >= 1, got {self.burst_requests!r}")
        if self.requests_per_minute is not None and self.requests_per_window < self.burst_requests:
            raise ValueError(
                f"requests_per_minute * window_s / 60 = {self.requests_per_window} requests per "
                f"window is below burst_requests={self.burst_requests}: raise "
                "requests_per_minute or window_s, or lower burst_requests"
            )
        if self.tokens_per_minute is not None and self.tokens_per_minute <= 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {self.tokens_per_minute!r}")

    @property
    def requests_per_window(self) -> int:
        """Whole requests allowed per ``window_s`` (0 without a request limit)."""
        if self.requests_per_minute is None:
            return 0
        # The small epsilon keeps 600 * 10 / 60 == 100, not 99.99999.
        return math.floor(self.requests_per_minute * self.window_s / 60.0 + 1e-9)

    def request_interval_s(self) -> float | None:
        """Seconds between two request slots at the steady pace."""
        if self.requests_per_minute is None:
            return None
        return (self.window_s + self.margin_s) / (
            self.requests_per_window - self.burst_requests + 1
        )

    def token_interval_s(self) -> float | None:
        """Seconds one token occupies in the token budget."""
        if self.tokens_per_minute is None:
            return None
        return (self.window_s + self.margin_s) / (self.tokens_per_minute * self.window_s / 60.0)

    def buckets(self, tokens: int) -> list[tuple[int, float, float, float]]:
        """``(kind, interval_s, tolerance_s, cost)`` per limited kind (0 = requests, 1 = tokens)."""
        out: list[tuple[int, float, float, float]] = []
        req = self.request_interval_s()
        if req is not None:
            out.append((0, req, (self.burst_requests - 1) * req, 1.0))
        tok = self.token_interval_s()
        if tok is not None:
            out.append((1, tok, 0.0, float(max(tokens, 0))))
        return out

    def describe(self) -> str:
        parts = []
        if self.requests_per_minute is not None:
            parts.append(f"{self.requests_per_minute:g} requests/min")
        if self.tokens_per_minute is not None:
            parts.append(f"{self.tokens_per_minute:g} tokens/min")
        return ", ".join(parts)


@runtime_checkable
class RateLimiter(Protocol):
    """Books a slot for each model call.

    ``await acquire(tokens)`` waits until the call may start and returns the seconds it
    waited; it raises ``RateLimitWaitError`` (booking nothing) when the wait would exceed
    the limit's ``max_wait_s``. ``await settle(reserved_tokens, used_tokens)`` corrects the
    token budget once the real usage is known. ``await aclose()`` releases connections
    (the limiter stays usable). A caller cancelled while waiting loses its slot: the
    budget is never exceeded because of it, only under-used.

    Example::

        waited_s = await limiter.acquire(tokens=1200)    # books the slot, returns the wait
        ...                                              # the call, which used 900 tokens
        await limiter.settle(1200, 900)
    """

    async def acquire(self, tokens: int = 0) -> float: ...

    async def settle(self, reserved_tokens: int, used_tokens: int) -> None: ...

    async def aclose(self) -> None: ...


def gcra_reserve(
    tats: Sequence[float],
    now: float,
    buckets: Sequence[tuple[int, float, float, float]],
    max_wait_s: float,
) -> tuple[float, list[float] | None]:
    """Book one slot in every bucket at once (the same algorithm as the Redis script).

    ``tats[i]`` is bucket i's theoretical arrival time, ``buckets[i]`` its
    ``(kind, interval_s, tolerance_s, cost)``. The slot starts at the earliest ``start >=
    now`` with ``start >= tat - tolerance`` in every bucket; each bucket then moves to
    ``max(start, tat) + cost * interval``. Returns ``(wait_s, new_tats)``, with
    ``new_tats = None`` (nothing booked) when the wait exceeds ``max_wait_s``.
    """
    start = now
    for tat, (_, _, tolerance, _) in zip(tats, buckets, strict=True):
        start = max(start, tat - tolerance)
    wait = start - now
    if wait > max_wait_s:
        return wait, None
    return wait, [
        max(start, tat) + cost * interval
        for tat, (_, interval, _, cost) in zip(tats, buckets, strict=True)
    ]


def _wait_error(limit: RateLimit, name: str, wait_s: float) -> RateLimitWaitError:
    return RateLimitWaitError(
        f"rate limit {name!r} ({limit.describe()}) would make this call wait {wait_s:.1f}s, "
        f"more than max_wait_s={limit.max_wait_s:g}; nothing was booked. Lower the "
        "concurrency, raise max_wait_s, or raise the limit if your provider allows it",
        wait_s=wait_s,
        max_wait_s=limit.max_wait_s,
    )


class LocalRateLimiter:
    """An in-process ``RateLimiter``: one budget shared by everything using this object.

    Works on asyncio and trio, and across threads (booking takes a lock for a few
    microseconds; waiting is ``anyio.sleep``).

    Example::

        shared = LocalRateLimiter(RateLimit(requests_per_minute=500))
        fast = OpenAIChat("gpt-4o-mini", rate_limit=shared)
        careful = OpenAIChat("gpt-4o-mini", default_params={"temperature": 0}, rate_limit=shared)
    """

    def __init__(
        self, limit: RateLimit, *, name: str = "local", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._tats = [0.0, 0.0]  # requests, tokens

    def reserve(self, tokens: int = 0) -> float:
        """Book a slot without waiting; return the seconds until it starts."""
        buckets = self.limit.buckets(tokens)
        with self._lock:
            now = self._clock()
            wait, new = gcra_reserve(
                [self._tats[kind] for kind, *_ in buckets], now, buckets, self.limit.max_wait_s
            )
            if new is not None:
                for (kind, *_), tat in zip(buckets, new, strict=True):
                    self._tats[kind] = tat
        if new is None:
            raise _wait_error(self.limit, self.name, wait)
        return max(wait, 0.0)

    async def acquire(self, tokens: int = 0) -> float:
        wait = self.reserve(tokens)
        if wait > 0:
            await anyio.sleep(wait)
        return wait

    async def settle(self, reserved_tokens: int, used_tokens: int) -> None:
        interval = self.limit.token_interval_s()
        if interval is None or used_tokens == reserved_tokens:
            return
        with self._lock:
            now = self._clock()
            self._tats[1] = max(now, self._tats[1] + (used_tokens - reserved_tokens) * interval)

    async def aclose(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"LocalRateLimiter({self.limit.describe()}, name={self.name!r})"


# NOTE [Limiter calls sent twice]
# A booking or a correction whose reply is lost may have been applied: sent again
# blindly, it would book a second slot (or correct the budget twice). So each call
# carries a random id, and its script first looks for the call's "once" key
# (``rate_limit_once_key``): there, a booking keeps the start of its slot, and a
# correction a mark. Found, the script does nothing more and answers as the first run
# did (a booking: its slot, counted from now); not found, it does the work and writes
# the key. That makes both safe to send again (``run_script(..., retry=True)``). The key
# lives for two of the client's Redis deadlines and a second (``_once_ttl_ms``): the
# repeat leaves when the first attempt fails, at most one deadline after it, and reaches
# Redis within its own; so at most the calls of that span have a key.

# KEYS: one GCRA "theoretical arrival time" (microseconds, Redis clock) per bucket, then
# the call's once key. ARGV: max_wait_us, once_ttl_ms, then per bucket: interval_us,
# tolerance_us, cost. Returns {1, wait_us} when booked, {0, wait_us} when the wait
# exceeds max_wait_us (nothing booked). See NOTE [Limiter calls sent twice].
_RESERVE_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local once = KEYS[#KEYS]
local booked = redis.call('GET', once)
if booked then return {1, math.ceil(tonumber(booked) - now)} end
local max_wait = tonumber(ARGV[1])
local start = now
local tats = {}
for i = 1, #KEYS - 1 do
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  tats[i] = tat
  local s = tat - tonumber(ARGV[i * 3 + 1])
  if s > start then start = s end
end
local wait = math.ceil(start - now)
if wait > max_wait then return {0, wait} end
for i = 1, #KEYS - 1 do
  local base = tats[i]
  if start > base then base = start end
  local new_tat = math.ceil(base + tonumber(ARGV[i * 3]) * tonumber(ARGV[i * 3 + 2]))
  local ttl_ms = math.ceil((new_tat - now) / 1000) + 1000
  redis.call('SET', KEYS[i], string.format('%.0f', new_tat), 'PX', ttl_ms)
end
redis.call('SET', once, string.format('%.0f', start), 'PX', ARGV[2])
return {1, wait}
"""

# KEYS: the tokens key, the call's once key. ARGV: token delta (used - reserved),
# interval_us, once_ttl_ms. See NOTE [Limiter calls sent twice].
_SETTLE_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local new_tat = math.ceil(tat + tonumber(ARGV[1]) * tonumber(ARGV[2]))
if new_tat <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000) + 1000)
return 1
"""
_RESERVE = Script(_RESERVE_LUA)
_SETTLE = Script(_SETTLE_LUA)


class RedisRateLimiter:
    """A ``RateLimiter`` shared by every process that uses the same Redis and ``name``.

    One Lua script books the slot atomically against Redis's clock (so the machines'
    clocks do not matter); the caller then sleeps until the slot. Each Redis call has a
    ``limit.redis_timeout_s`` timeout and raises ``ModelBackendError`` when Redis fails.
    A call whose connection is lost is sent again, and still books (or corrects) once
    (see NOTE [Limiter calls sent twice]). Every process must use the same ``RateLimit``
    numbers for one ``name``.

    Example::

        limiter = RedisRateLimiter(
            RateLimit(requests_per_minute=500), name="openai", redis_url="redis://127.0.0.1:6379/0"
        )
        model = OpenAIChat("gpt-4o-mini", rate_limit=limiter)   # one budget for every process
    """

    def __init__(self, limit: RateLimit, *, name: str, redis_url: str | None = None) -> None:
        url = redis_url or limit.redis_url
        if not url:
            raise ValueError("RedisRateLimiter needs a redis_url (argument or RateLimit.redis_url)")
        if not name:
            raise ValueError("RedisRateLimiter needs a non-empty name: the budget's Redis key")
        self.limit = limit
        self.name = name
        self._keys = rate_limit_keys(name)
        self._once_ttl_ms = math.ceil((2 * limit.redis_timeout_s + 1) * 1000)
        self._redis = RedisHandle(
            url, timeout_s=limit.redis_timeout_s, purpose=f"rate limit {name!r}"
        )

    async def reserve(self, tokens: int = 0) -> float:
        """Book a slot without waiting; return the seconds until it starts."""
        buckets = self.limit.buckets(tokens)
        keys = [self._keys[kind] for kind, *_ in buckets]
        keys.append(self._once_key())
        # Lua's tonumber() cannot read 'inf'; a year is as good as forever here.
        args: list[str] = [repr(min(self.limit.max_wait_s, 3.2e7) * 1e6), str(self._once_ttl_ms)]
        for _, interval, tolerance, cost in buckets:
            args += [repr(interval * 1e6), repr(tolerance * 1e6), repr(cost)]

        granted, wait = await self._redis.run_script(_RESERVE, keys, args, retry=True)
        wait_us = float(wait)
        if not granted:
            raise _wait_error(self.limit, self.name, wait_us / 1e6)
        return max(wait_us / 1e6, 0.0)

    async def acquire(self, tokens: int = 0) -> float:
        wait = await self.reserve(tokens)
        if wait > 0:
            await anyio.sleep(wait)
        return wait

    async def settle(self, reserved_tokens: int, used_tokens: int) -> None:
        interval = self.limit.token_interval_s()
        if interval is None or used_tokens == reserved_tokens:
            return
        args = [
            repr(float(used_tokens - reserved_tokens)),
            repr(interval * 1e6),
            str(self._once_ttl_ms),
        ]
        keys = [self._keys[1], self._once_key()]

        await self._redis.run_script(_SETTLE, keys, args, retry=True)

    def _once_key(self) -> str:
        """A fresh call's once key (NOTE [Limiter calls sent twice])."""
        return rate_limit_once_key(self.name, secrets.token_hex(8))

    async def aclose(self) -> None:
        await self._redis.aclose()

    def __repr__(self) -> str:
        return f"RedisRateLimiter({self.limit.describe()}, name={self.name!r})"


def make_rate_limiter(limit: RateLimit | RateLimiter, *, default_name: str) -> RateLimiter:
    """The limiter a model uses: ``limit`` itself if it is one, else one built from it."""
    if not isinstance(limit, RateLimit):
        return limit
    name = limit.name or default_name
    if limit.redis_url:
        return RedisRateLimiter(limit, name=name)
    return LocalRateLimiter(limit, name=name)
