"""Secrets out of everything asyncgraph prints, logs, traces or writes: one home.

A leaf (it imports nothing of asyncgraph), so the Redis client, the model clients,
observability, the fleet and the command line all redact the same way:

- :func:`redact_url`: a URL without the password of its userinfo and without the values
  of query parameters that carry credentials (``?password=``, ``?api-key=``, ...), for
  ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``http(s)://``;
- :func:`url_host`: only the host (and port) of a URL, for attributes such as
  OpenTelemetry's ``server.address``;
- :func:`redact`: free text (an error message, a model's reply quoting a key, a log line)
  with the URLs in it redacted, the values of the environment's secret-looking
  variables replaced, and bearer tokens and ``sk-...`` keys masked;
- :func:`url_secrets`: the secrets a URL carries (its password, its credential query
  values), for a client that redacts text with its own secrets (``redact(text, ...)``);
- :class:`RedactingFormatter`: a ``logging.Formatter`` whose every line, traceback
  included, goes through :func:`redact` (the command line's log handlers use it);
- :class:`RedactingFilter`: a ``logging.Filter`` that redacts each record's message,
  for another library's logger whose records we do not format (httpx logs each
  request's URL, ``?api-key=`` included).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

__all__ = [
    "REDACTED",
    "RedactingFilter",
    "RedactingFormatter",
    "redact",
    "redact_url",
    "secret_values",
    "url_host",
    "url_secrets",
]

REDACTED = "[redacted]"
MASK = "***"

# Names of environment variables, and of query parameters, whose values are credentials.
_SECRET_VARIABLE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
_SECRET_PARAMETER = re.compile(
    r"key|token|secret|password|passwd|\bpwd\b|\bpass\b|credential|signature|\bsig\b|"
    r"\bauth\b|authorization",
    re.IGNORECASE,
)
_SECRET_SHAPES = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}|\bsk-[A-Za-z0-9_-]{12,}")
# scheme://user:PASSWORD@ (any characters up to the last '@' of the URL but a MASK).
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:?#]*:)(?!\*\*\*@)(.*)@(?=[^@]*$)", re.I)
_URL = re.compile(r"\b(?:rediss?|unix|redis\+sentinel|redis\+cluster|https?)://[^\s'\"<>]+")


def _secret_name(name: str) -> bool:
    return bool(_SECRET_PARAMETER.search(name.replace("-", " ").replace("_", " ")))


def redact_url(url: str) -> str:
    """``url`` with its userinfo password and its credential query values masked.

    ``redis://default:pw@host:6379/0?password=pw2`` becomes
    ``redis://default:***@host:6379/0?password=***``; a URL with nothing secret is
    returned unchanged, and text that is not a URL is returned as it is.

    Example::

        print(redact_url("redis://default:pw@host:6379/0"))    # redis://default:***@host:6379/0
    """
    # A password written unencoded may hold '#', '/' or '?', which would end the
    # authority for urlsplit: mask everything between "user:" and the last '@' first.
    url = _USERINFO.sub(rf"\1{MASK}@", url, count=1)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # a malformed port or bracket: mask what looks like userinfo
        return re.sub(r"(//[^/@:]*:)[^/@]*@", rf"\1{MASK}@", url)
    netloc = parts.netloc
    if password is not None:
        host = netloc.rsplit("@", 1)[-1]
        user = f"{parts.username}:{MASK}@" if parts.username else f":{MASK}@"
        netloc = user + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_name(name) for name, _ in pairs):
            query = urlencode(
                [(name, MASK if _secret_name(name) else value) for name, value in pairs],
                safe="*",
            )
    if netloc == parts.netloc and query == parts.query:
        return url
    # By hand, not urlunsplit, which drops the empty authority of unix:///path.
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else f"{netloc}{parts.path}"
    return (
        rebuilt + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    )


def url_host(url: str) -> str:
    """The host of ``url`` (with its port when it has one), nothing else: no userinfo,
    path or query. ``""`` when ``url`` has no host."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{host}:{port}" if host and port is not None else host


def url_secrets(url: str) -> list[str]:
    """The secrets ``url`` carries: the password of its userinfo and the values of its
    credential query parameters (what :func:`redact_url` masks), non-empty ones only."""
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
    except ValueError:
        return []
    found.append(unquote(found[0]))  # as written, and as the client sends it
    found += [value for name, value in parse_qsl(parts.query) if _secret_name(name)]
    return list(dict.fromkeys(value for value in found if value))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the environment's secret-looking variables (8 characters or more),
    longest first (so a key that contains another is replaced whole)."""
    env = os.environ if environ is None else environ
    found = {
        value for name, value in env.items() if _SECRET_VARIABLE.search(name) and len(value) >= 8
    }
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with its URLs redacted (``redact_url``), every value of ``secrets``
    (default: ``secret_values()``) replaced by ``[redacted]``, and bearer tokens and
    ``sk-...`` keys masked."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    for secret in secret_values() if secrets is None else secrets:
        if secret and secret in text:
            text = text.replace(secret, REDACTED)
    return _SECRET_SHAPES.sub(lambda m: (m.group(1) or "") + REDACTED, text)


class RedactingFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose output (message, traceback and all) goes through
    :func:`redact` with ``secrets`` plus the environment's secret values read when it was
    made.

    What a handler prints can quote a URL or an exception text from anywhere (a library's
    log line, a traceback): redacting the formatted line catches them all at the last step.
    """

    def __init__(
        self, fmt: str | None = None, datefmt: str | None = None, secrets: Iterable[str] = ()
    ) -> None:
        super().__init__(fmt, datefmt)
        self._secrets = sorted({*secret_values(), *secrets} - {""}, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record), self._secrets)


class RedactingFilter(logging.Filter):
    """A ``logging.Filter`` that replaces each record's message with it passed through
    :func:`redact` (URLs' credentials, the environment's secrets, bearer and ``sk-``
    keys); it keeps every record. Added to a logger, it sees the records logged to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        shown = redact(message)
        if shown != message:
            record.msg, record.args = shown, ()
        return True
