from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncgraph.models import Retry
from asyncgraph.models._testing import OpenAITestServer


@pytest.fixture
def server() -> Iterator[OpenAITestServer]:
    """A real OpenAI-protocol HTTP server on a free 127.0.0.1 port, scriptable per test."""
    with OpenAITestServer() as srv:
        yield srv


@pytest.fixture
def fast_retry() -> Retry:
    """Retries with millisecond backoff, so retry tests take no time."""
    return Retry(max_attempts=3, backoff_base_s=0.005, backoff_max_s=0.02)
