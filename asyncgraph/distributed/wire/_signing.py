"""HMAC-SHA256 signatures of packed messages, compared in constant time.

With a shared secret (``--secret`` / ``ASYNCGRAPH_SECRET`` on workers,
``secret=`` on the client) every task, reply and cancellation carries
``HMAC-SHA256(secret, packed message)``; a receiver with a secret rejects
messages that are unsigned or whose signature does not match. The message
itself names its queue and kind (every message's ``q`` and ``k`` in ``_schema``),
so a signed message cannot be replayed as another kind or into another queue.

NOTE [Sealed records]: everything the fleet keeps in Redis and reads back later (the
call journal of a task's model calls, the replay memory of the tasks that ran, any
record added later) goes through ``Signer.seal`` when written and ``Signer.unseal``
when read; nothing else reads such a record. With a secret, a sealed record is::

    b"hmac1:" + hex HMAC-SHA256(record key, len|key, len|field, payload) + b":" + payload

where the record key is derived from the secret (``HMAC(secret, b"asyncgraph
record")``), so a record's MAC is never a message's signature, and the MAC binds the
Redis key and the hash field (``b""`` for a plain string key) the record was written
under: the same bytes copied to another key or field (another task, another call)
fail. ``unseal`` returns the payload, or None for a record that is unsealed, forged,
moved or corrupt: the caller ignores it (as if absent) and reports it, never uses it.
Without a secret, ``seal`` returns the payload unchanged and ``unseal`` returns what
it read: an unsigned fleet trusts its Redis, as it trusts its tasks. A fleet runs with
one secret on every worker; records sealed under another secret (or none) read as
absent, which costs a repeated call, never a wrong answer.

Sealing proves who wrote a record, not that it is still there: a record deleted by
someone with write access to Redis is absent, not forged. What each Redis ACL role can
do to the fleet is in the security guide (docs/how-to/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

__all__ = ["Signer", "secret_from_env"]

SECRET_ENV = "ASYNCGRAPH_SECRET"

SEALED = b"hmac1:"  # the marker of a sealed record (see NOTE [Sealed records])
_MAC_HEX = 64  # hex digits of an HMAC-SHA256
_RECORD_KEY_LABEL = b"asyncgraph record"  # derives the records' key from the secret


def secret_from_env() -> str | None:
    """The secret in ``ASYNCGRAPH_SECRET``, or None when unset or empty."""
    return os.environ.get(SECRET_ENV) or None


class Signer:
    """Signs and verifies message bytes; ``Signer(None)`` signs nothing and accepts all."""

    __slots__ = ("_key", "_record_key")

    def __init__(self, secret: str | bytes | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) < 16:
            raise ValueError(
                "the shared secret must be at least 16 bytes long; generate one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        self._key = secret
        self._record_key = (
            None if secret is None else hmac.new(secret, _RECORD_KEY_LABEL, hashlib.sha256).digest()
        )

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

    def seal(self, key: str | bytes, field: str | bytes, payload: bytes) -> bytes:
        """The value to store for ``payload`` under Redis ``key`` and hash ``field``
        (``b""`` for a string key): the payload with an HMAC bound to both, or the payload
        itself without a secret. See NOTE [Sealed records].

        Example::

            stored = signer.seal("asyncgraph:{q}:calls:<client>:<task>", "d1:0", b"{...}")
            signer.unseal("asyncgraph:{q}:calls:<client>:<task>", "d1:0", stored)  # b"{...}"
            signer.unseal("asyncgraph:{q}:calls:<client>:<task>", "d2:0", stored)  # None
        """
        if self._record_key is None:
            return payload
        return SEALED + self._record_mac(key, field, payload) + b":" + payload

    def unseal(self, key: str | bytes, field: str | bytes, stored: object) -> bytes | None:
        """The payload of a record read from Redis ``key`` and hash ``field``, or None
        when it fails verification: not sealed, sealed with another secret, moved from
        another key or field, or corrupt (or not bytes at all). Never raises; the caller
        treats None as an absent record and reports it.

        Without a secret, ``stored`` itself (None if it is not bytes).
        """
        if not isinstance(stored, bytes):
            return None
        if self._record_key is None:
            return stored
        head = len(SEALED) + _MAC_HEX
        if len(stored) <= head or not stored.startswith(SEALED) or stored[head : head + 1] != b":":
            return None
        payload = stored[head + 1 :]
        if not hmac.compare_digest(
            stored[len(SEALED) : head], self._record_mac(key, field, payload)
        ):
            return None
        return payload

    def _record_mac(self, key: str | bytes, field: str | bytes, payload: bytes) -> bytes:
        assert self._record_key is not None
        key_b = key.encode() if isinstance(key, str) else key
        field_b = field.encode() if isinstance(field, str) else field
        mac = hmac.new(self._record_key, digestmod=hashlib.sha256)
        mac.update(struct.pack(">II", len(key_b), len(field_b)))  # no key|field ambiguity
        mac.update(key_b)
        mac.update(field_b)
        mac.update(payload)
        return mac.hexdigest().encode()
