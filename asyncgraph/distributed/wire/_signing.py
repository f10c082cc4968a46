"""HMAC-SHA256 signatures of packed messages, compared in constant time.

With a shared secret (``--secret`` / ``ASYNCGRAPH_SECRET`` on workers,
``secret=`` on the client) every task, reply and cancellation carries
``HMAC-SHA256(secret, packed message)``; a receiver with a secret rejects
messages that are unsigned or whose signature does not match. The message
itself names its queue and kind (every message's ``q`` and ``k`` in ``_schema``),
so a signed message cannot be replayed as another kind or into another queue.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["Signer", "secret_from_env"]

SECRET_ENV = "ASYNCGRAPH_SECRET"


def secret_from_env() -> str | None:
    """The secret in ``ASYNCGRAPH_SECRET``, or None when unset or empty."""
    return os.environ.get(SECRET_ENV) or None


class Signer:
    """Signs and verifies message bytes; ``Signer(None)`` signs nothing and accepts all."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) < 16:
            raise ValueError(
                "the shared secret must be at least 16 bytes long; generate one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        self._key = secret

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def sign(self, message: bytes) -> bytes:
        """The hex signature of ``message`` (empty when no secret is set)."""
        if self._key is None:
            return b""
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def verify(self, message: bytes, signature: bytes | None) -> str | None:
        """None when ``message`` is acceptable, else the reason it is not."""
        if self._key is None:
            return None
        if not signature:
            return "unsigned message (this side requires an HMAC signature)"
        expected = hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(expected, signature):
            return "bad HMAC signature (forged, corrupted, or signed with another secret)"
        return None
