"""One redaction for every URL and secret (asyncgraph/_redact.py)."""

from __future__ import annotations

import logging
import sys

import pytest

from asyncgraph._redact import (
    REDACTED,
    RedactingFilter,
    RedactingFormatter,
    redact,
    redact_url,
    secret_values,
    url_host,
    url_secrets,
)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://default:pw1@h:6379/0", "redis://default:***@h:6379/0"),
        ("redis://:pw1@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://h/0?password=pw2&db=1", "redis://h/0?password=***&db=1"),
        ("unix:///tmp/r.sock?password=pw3&db=2", "unix:///tmp/r.sock?password=***&db=2"),
        ("rediss://u:pw1@h:6380/0?password=pw2", "rediss://u:***@h:6380/0?password=***"),
        (
            "redis+sentinel://:pw1@a:1,b:2/svc?sentinel_password=pw4",
            "redis+sentinel://:***@a:1,b:2/svc?sentinel_password=***",
        ),
        ("http://user:pass@h/v1?api-key=K9&x=1", "http://user:***@h/v1?api-key=***&x=1"),
        (
            "https://e.azure.com/o?api-version=2024-10-21&api_key=K",
            "https://e.azure.com/o?api-version=2024-10-21&api_key=***",
        ),
        ("https://h/v1?token=t&sig=s&auth=a", "https://h/v1?token=***&sig=***&auth=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url_masks_userinfo_and_credential_parameters(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_url_host_is_the_host_and_port_only() -> None:
    assert url_host("http://user:pass@example.com:8443/v1?api-key=K") == "example.com:8443"
    assert url_host("https://example.com/v1") == "example.com"
    assert url_host("http://[::1]:8080/x") == "[::1]:8080"
    assert url_host("unix:///tmp/r.sock") == ""


def test_secret_values_are_those_of_secret_looking_variables_longest_first() -> None:
    env = {
        "OPENAI_API_KEY": "sk-test-abcdefgh",
        "MY_TOKEN": "tok-12345678-long",
        "PWD": "/home/user/project",  # the working directory: not a secret
        "SHORT_KEY": "abc",  # too short to replace safely
        "HOME": "/home/user",
    }
    assert secret_values(env) == ["tok-12345678-long", "sk-test-abcdefgh"]


def test_redact_free_text() -> None:
    text = (
        "failed: redis://:hunter22@h:1/0?password=hunter33 said 'Bearer abcdefghijkl', "
        "the reply quoted my-secret-value-123 and sk-abcdefghijklmnop"
    )
    out = redact(text, ["my-secret-value-123"])
    for secret in ("hunter22", "hunter33", "abcdefghijkl", "my-secret-value-123", "sk-abc"):
        assert secret not in out
    assert "redis://:***@h:1/0?password=***" in out and out.count(REDACTED) == 3


def test_url_secrets_are_the_password_and_credential_query_values() -> None:
    assert url_secrets("http://u:p%40ss@h/v1?api-key=K9&x=1&token=T") == [
        "p%40ss",
        "p@ss",
        "K9",
        "T",
    ]
    assert url_secrets("redis://h:6379/0?db=1") == []
    assert url_secrets("redis://h:bad-port/0") == []


def test_redacting_formatter_redacts_the_message_and_the_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "env-token-123456")
    formatter = RedactingFormatter("%(levelname)s %(message)s", secrets=["own-secret-987"])
    try:
        raise RuntimeError("own-secret-987 failed at redis://:pw-in-trace@h/0")
    except RuntimeError:
        record = logging.LogRecord(
            "x",
            logging.WARNING,
            __file__,
            1,
            "lost %s (%s)",
            ("redis://h/0?password=pq1", "env-token-123456"),
            sys.exc_info(),
        )
    line = formatter.format(record)
    assert line.startswith("WARNING lost redis://h/0?password=*** ([redacted])")
    assert "Traceback" in line and "RuntimeError: [redacted] failed at redis://:***@h/0" in line
    for secret in ("pq1", "env-token-123456", "own-secret-987", "pw-in-trace"):
        assert secret not in line


def test_redacting_filter_redacts_a_records_message_and_keeps_it() -> None:
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("asyncgraph-test-redacting-filter")
    handler = Collect()
    logger.addHandler(handler)
    logger.addFilter(RedactingFilter())
    logger.setLevel(logging.INFO)
    try:
        logger.info('HTTP Request: POST %s "%s"', "http://u:f-pass@h/v1?api-key=f-key", "200 OK")
        logger.info("nothing secret in %s", "this")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        'HTTP Request: POST http://u:***@h/v1?api-key=*** "200 OK"',
        "nothing secret in this",
    ]


@pytest.mark.parametrize("password", ["se#cretpw", "p/w?x", "a@b"])
def test_an_unencoded_password_with_url_delimiters_is_masked_whole(password: str) -> None:
    shown = redact_url(f"redis://user:{password}@127.0.0.1:6379/0?password=z")
    assert password not in shown and "z" not in shown.split("?")[-1].split("=")[-1]
    assert shown == "redis://user:***@127.0.0.1:6379/0?password=***"
