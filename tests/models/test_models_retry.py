"""The retry policy: backoff growth and jitter, Retry-After in every form (no real sleeps)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import httpx
import pytest

from asyncgraph.models import Retry
from asyncgraph.models._retry import parse_retry_after

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def headers(**values: str) -> httpx.Headers:
    return httpx.Headers({k.replace("_", "-"): v for k, v in values.items()})


def test_retry_after_seconds_and_milliseconds() -> None:
    assert parse_retry_after(headers(retry_after="7")) == 7.0
    assert parse_retry_after(headers(retry_after=" 1.5 ")) == 1.5
    assert parse_retry_after(headers(retry_after_ms="250")) == 0.25
    # The finer header wins when a server sends both (OpenAI does).
    assert parse_retry_after(headers(retry_after="1", retry_after_ms="250")) == 0.25
    assert parse_retry_after(headers(retry_after_ms="junk", retry_after="2")) == 2.0


def test_retry_after_as_an_http_date_is_relative_to_now() -> None:
    assert parse_retry_after(headers(retry_after="Wed, 01 Jan 2025 12:00:30 GMT"), NOW) == 30.0
    # A date in the past means "retry now", not a negative wait.
    assert parse_retry_after(headers(retry_after="Wed, 01 Jan 2025 11:00:00 GMT"), NOW) == 0.0
    # RFC 850 and asctime forms are HTTP dates too.
    assert parse_retry_after(headers(retry_after="Wednesday, 01-Jan-25 12:01:00 GMT"), NOW) == 60.0
    assert parse_retry_after(headers(retry_after="Wed Jan  1 12:00:10 2025"), NOW) == 10.0
    naive_now = NOW.replace(tzinfo=None)
    assert parse_retry_after(headers(retry_after="Wed, 01 Jan 2025 12:00:05 GMT"), naive_now) == 5.0


@pytest.mark.parametrize("value", ["", "soon", "-3", "nan", "inf", "Wed, 99 Foo 2025"])
def test_unreadable_retry_after_is_ignored(value: str) -> None:
    assert parse_retry_after(headers(retry_after=value), NOW) is None
    assert parse_retry_after(headers()) is None


def test_backoff_doubles_with_equal_jitter_up_to_the_cap() -> None:
    retry = Retry(backoff_base_s=0.5, backoff_max_s=4.0, rng=random.Random(1))
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0), (9, 4.0)]:
        delays = [retry.backoff_s(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > ceiling / 4  # really jittered, not constant


def test_retry_after_gets_a_bounded_jitter_and_is_capped() -> None:
    retry = Retry(retry_after_max_s=10.0, retry_after_jitter=0.2, rng=random.Random(2))
    delays = [retry.backoff_s(1, retry_after_s=5.0) for _ in range(200)]
    assert all(5.0 <= d <= 6.0 for d in delays)
    assert max(delays) - min(delays) > 0.5  # concurrent 429s do not come back in lockstep
    capped = [retry.backoff_s(1, retry_after_s=3600.0) for _ in range(200)]
    assert all(10.0 <= d <= 12.0 for d in capped)
    exact = Retry(retry_after_jitter=0)
    assert exact.backoff_s(3, retry_after_s=2.0) == 2.0


def test_seeded_rng_gives_reproducible_delays() -> None:
    a = Retry(rng=random.Random(7))
    b = Retry(rng=random.Random(7))
    assert [a.backoff_s(n) for n in range(1, 6)] == [b.backoff_s(n) for n in range(1, 6)]


def test_invalid_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        Retry(max_attempts=0)
    with pytest.raises(TypeError, match="max_attempts"):
        Retry(max_attempts=True)
    with pytest.raises(ValueError, match="jitter"):
        Retry(retry_after_jitter=-0.1)
    with pytest.raises(ValueError, match=">= 0"):
        Retry(backoff_base_s=float("nan"))
