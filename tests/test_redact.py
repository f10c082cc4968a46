"""One redaction for every URL and secret (asyncgraph/_redact.py): URLs, the environment's
and the registered secrets in the forms servers echo them, headers, a job's config."""

from __future__ import annotations

import base64
import logging
import sys

import pytest

from asyncgraph._redact import (
    REDACTED,
    RedactingFilter,
    RedactingFormatter,
    Secret,
    header_secrets,
    redact,
    redact_data,
    redact_url,
    register_secret,
    secret_name,
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


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "api_key",
        "api-key",
        "X-Api-Key",
        "Authorization",
        "Proxy-Authorization",
        "Ocp-Apim-Subscription-Key",
        "x-goog-api-key",
        "Cookie",
        "Set-Cookie",
        "X-Auth-Token",
        "accessToken",
        "ACCESSTOKEN",
        "client_secret",
        "sentinel_password",
        "passwd",
        "sig",
        "X-Amz-Signature",
        "credentials",
    ],
)
def test_a_credential_name_is_one(name: str) -> None:
    assert secret_name(name)


@pytest.mark.parametrize(
    "name", ["max_tokens", "keyword", "author", "content-type", "anthropic-version", "model", ""]
)
def test_an_ordinary_name_is_not_a_credential(name: str) -> None:
    assert not secret_name(name)


# -- the forms a server echoes a secret in --------------------------------------------------

KEY = "sk-proj-4f9Qa8ZkT2mX7cV1bN3dR6hJwq0Ls5"  # key-like: prefix "sk-proj-", then the core
CORE = KEY.removeprefix("sk-proj-")


@pytest.mark.parametrize(
    "echo",
    [
        KEY,
        KEY.upper(),
        KEY.lower(),
        CORE,  # without its provider prefix
        CORE.upper(),
        f"{KEY[:20]} {KEY[20:]}",  # split by a space
        "\n".join([KEY[:10], KEY[10:25], KEY[25:]]),  # wrapped over lines
        " ".join(KEY),  # a space after every character
        CORE[:12],  # its start, cut short
        CORE[:18] + "...",
        "..." + CORE[-12:],  # its end, after a masked middle
        f"{CORE[:14].upper()} {CORE[14:20]}",  # cut short, upper-cased and split
        f"{CORE[-20:-10]} {CORE[-10:]}",  # its end, split
        f"{KEY}_suffix",  # inside a longer word: the word goes
    ],
)
def test_a_registered_key_is_masked_in_the_forms_servers_echo_it(echo: str) -> None:
    register_secret(KEY)
    shown = redact(f"error: invalid key {echo} (check it)")
    assert shown.startswith("error: invalid key ") and shown.endswith(" (check it)")
    assert REDACTED in shown
    flat = "".join(shown.split()).lower()
    for piece in (CORE[:8], CORE[8:16], CORE[16:24], CORE[-8:]):
        assert piece.lower() not in flat, (echo, shown)


def test_a_short_middle_part_and_ordinary_words_are_left() -> None:
    register_secret(KEY)
    text = "sk-proj-****Ls5 was refused; max_tokens 256, international keyword, 2mX7cV1b"
    assert redact(text) == text  # 8 characters from its middle give nothing away


def test_a_secret_that_is_not_key_like_is_masked_whole_in_any_case_and_spacing() -> None:
    register_secret("correct horse battery")
    shown = redact("they said CORRECT HORSE  BATTERY and correcthorsebattery, not correct horse")
    assert shown == "they said [redacted] and [redacted], not correct horse"


def test_a_percent_encoded_secret_is_masked() -> None:
    register_secret("p@ss/w0rd+x")
    assert redact("sent ?pw=p%40ss%2Fw0rd%2Bx&x=1") == "sent ?pw=[redacted]&x=1"


def test_a_value_of_the_environment_is_masked_in_every_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VENDOR_API_KEY", "vk-live-Hq4zT8pL2mW9xC6n")
    assert redact("echo HQ4ZT8PL 2MW9XC6N") == "echo [redacted]"


def test_short_values_are_not_registered_nor_marked() -> None:
    register_secret("short1")  # ignored: masked everywhere it would take words with it
    assert redact("a short1 word") == "a short1 word"
    with pytest.raises(ValueError, match="8 characters or more, got 5"):
        Secret("abcde")
    with pytest.raises(TypeError, match="takes a str"):
        register_secret(b"bytes-value-123")  # type: ignore[arg-type]


def test_a_marked_secret_is_registered_and_hides_in_its_repr() -> None:
    marked = Secret("tenant-pass-Jm4Rq8Zx")
    assert marked == "tenant-pass-Jm4Rq8Zx" and repr(marked) == "Secret('***')"
    assert redact("tenant TENANT-PASS-JM4RQ8ZX") == "tenant [redacted]"


# -- headers --------------------------------------------------------------------------------


def test_the_credentials_of_headers_are_their_values_tokens_decoded_basics_and_cookies() -> None:
    basic = base64.b64encode(b"alice:wonder-land-9").decode()
    headers = {
        "Authorization": f"Bearer tok-{'a1' * 8}",
        "Proxy-Authorization": f"Basic {basic}",
        "api-key": "azure-key-0000",
        "x-api-key": "anthropic-key-1111",
        "Cookie": "theme=dark; session=sess-abcdef123",
        "X-Tenant": Secret("tenant-pass-Jm4Rq8Zx"),
        "content-type": "application/json",
        "X-Request-Id": "req-0123456789",
    }
    found = header_secrets(headers)
    for value in (
        f"Bearer tok-{'a1' * 8}",
        f"tok-{'a1' * 8}",
        basic,
        "alice:wonder-land-9",
        "wonder-land-9",
        "azure-key-0000",
        "anthropic-key-1111",
        "sess-abcdef123",
        "tenant-pass-Jm4Rq8Zx",
    ):
        assert value in found
    assert "application/json" not in found and "req-0123456789" not in found


# -- JSON data and a job's config -----------------------------------------------------------


def test_redact_data_redacts_every_string_and_by_name_the_credential_values() -> None:
    register_secret(KEY)
    config = {
        "base_url": "http://user:pw@host/v1?api-key=K&deployment=d",
        "api_key": "x",  # short: masked for its name
        "headers": {"Authorization": "Bearer t", "X-Trace": "on"},
        "auth": {"user": "bob", "password": "pw"},
        "max_tokens": 256,
        "note": f"quotes {KEY.upper()}",
        KEY: "a key as a key",
        "rounds": [1, "two"],
    }
    assert redact_data(config, by_name=True) == {
        "base_url": "http://user:***@host/v1?api-key=***&deployment=d",
        "api_key": "***",
        "headers": {"Authorization": "***", "X-Trace": "on"},
        "auth": {"user": "***", "password": "***"},
        "max_tokens": 256,
        "note": "quotes [redacted]",
        "[redacted]": "a key as a key",
        "rounds": [1, "two"],
    }
    # Without by_name only what is secret wherever it stands.
    assert redact_data({"api_key": "x", "n": 1.5, "ok": None})["api_key"] == "x"
