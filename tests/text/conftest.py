from __future__ import annotations

from collections.abc import Iterator

import pytest
from text_helpers import Recorder

from asyncgraph.text import unregister_model


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by a test; unregistered after it."""
    names: list[str] = []
    yield names
    for name in names:
        unregister_model(name)
