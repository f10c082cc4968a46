"""A task's error leaves the worker redacted: in the reply and in the dead letter."""

from __future__ import annotations

from typing import Any

import pytest

from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS
from asyncgraph.distributed.wire._schema import TaskMessage
from asyncgraph.distributed.wire._signing import Signer
from asyncgraph.distributed.worker._metrics import Metrics
from asyncgraph.distributed.worker._outcomes import Held, Replies


def _flat(value: Any) -> bytes:
    if isinstance(value, list | tuple):
        return b" ".join(_flat(item) for item in value)
    return value if isinstance(value, bytes) else str(value).encode()


def test_a_failed_tasks_error_and_traceback_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "worker-env-key-0123456789")
    replies = Replies("q", "w1", Signer("0123456789abcdef0123"), DEFAULT_LIMITS, Metrics())
    message = TaskMessage("q", "c" * 32, "t1", "f", "fp", "backward", 5000, {}, expiry_ms=5000)
    try:
        raise RuntimeError(
            "redis://:outcome-pass@h:1/0?password=outcome-pass-2 refused worker-env-key-0123456789"
        )
    except RuntimeError as exc:
        error = exc
    settled = replies.result(Held(b"1-0"), message, {}, None, error)
    written = _flat(settled.commands)
    assert b"RuntimeError" in written and b"redis://:***@h:1/0?password=***" in written
    for secret in (b"outcome-pass", b"worker-env-key-0123456789"):
        assert secret not in written
