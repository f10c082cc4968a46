"""Sealed records: what the fleet reads back from Redis carries an HMAC bound to its key
and field (NOTE [Sealed records] in ``wire._signing``)."""

from __future__ import annotations

import pytest

from asyncgraph.distributed.wire._keys import calls_key, ran_claims_key
from asyncgraph.distributed.wire._signing import SEALED, Signer

CLIENT = "ab" * 16
KEY = calls_key("q", CLIENT, "t1")
RECORD = b'{"text":"the answer","prompt_tokens":3}'


def test_a_sealed_record_unseals_under_its_own_key_and_field() -> None:
    signer = Signer("s" * 16)
    stored = signer.seal(KEY, "d1:0", RECORD)
    assert stored.startswith(SEALED) and stored.endswith(RECORD)
    assert signer.unseal(KEY, "d1:0", stored) == RECORD
    assert signer.unseal(KEY.encode(), b"d1:0", stored) == RECORD  # str or bytes alike
    assert (
        signer.unseal(
            ran_claims_key("q", CLIENT, 1),
            "1f",
            signer.seal(ran_claims_key("q", CLIENT, 1), "1f", b""),
        )
        == b""
    )


@pytest.mark.parametrize(
    ("key", "field"),
    [
        (calls_key("q", CLIENT, "t2"), "d1:0"),  # another task's journal
        (calls_key("q", "cd" * 16, "t1"), "d1:0"),  # another client's
        (calls_key("other", CLIENT, "t1"), "d1:0"),  # another queue's
        (KEY, "d1:1"),  # another call of the same task
        (KEY, "d2:0"),
        (KEY + "d1", ":0"),  # the same bytes key|field, split elsewhere
    ],
)
def test_a_record_moved_to_another_key_or_field_fails(key: str, field: str) -> None:
    signer = Signer("s" * 16)
    assert signer.unseal(key, field, signer.seal(KEY, "d1:0", RECORD)) is None


@pytest.mark.parametrize(
    "stored",
    [
        RECORD,  # unsealed: what an attacker without the secret writes
        Signer("t" * 16).seal(KEY, "d1:0", RECORD),  # sealed with another secret
        Signer("s" * 16).seal(KEY, "d1:0", RECORD)[:-1] + b"X",  # payload changed
        Signer("s" * 16).seal(KEY, "d1:0", RECORD).replace(SEALED, b"hmac2:"),
        SEALED,
        SEALED + b"0" * 64,  # no separator
        SEALED + b"0" * 64 + b":" + RECORD,
        b"",
        None,  # absent
        42,  # not bytes (a reply of another type)
        [b"a"],
    ],
)
def test_an_unsealed_forged_or_corrupt_record_reads_as_none(stored: object) -> None:
    assert Signer("s" * 16).unseal(KEY, "d1:0", stored) is None


def test_a_record_mac_is_not_a_message_signature() -> None:
    # The records' key is derived from the secret: a signed message's bytes and signature
    # do not make a sealed record.
    signer = Signer("s" * 16)
    forged = SEALED + signer.sign(RECORD) + b":" + RECORD
    assert signer.unseal(KEY, "", forged) is None


def test_without_a_secret_records_are_stored_and_read_as_they_are() -> None:
    signer = Signer(None)
    assert signer.seal(KEY, "d1:0", RECORD) == RECORD
    assert signer.unseal(KEY, "d1:0", RECORD) == RECORD
    assert signer.unseal(KEY, "d1:0", None) is None
