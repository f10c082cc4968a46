"""Secrets out of everything asyncgraph prints, logs, traces or writes: one home.

A leaf (it imports nothing of asyncgraph), so the Redis client, the model clients,
observability, the fleet, the jobs and the command line all redact the same way, and
``asyncgraph._files`` writes every file through it. See NOTE [Redaction] below for what
is masked and in which forms.

- :func:`redact`: free text (an error message, a model's reply quoting a key, a log line);
- :func:`redact_data`: JSON data (a checkpoint, a call log line, a trace, MLflow params),
  each string through :func:`redact`; with ``by_name=True`` (a job's ``config``) the
  values under credential names (``api_key``, ``token``, ``Authorization``...) masked too;
- :func:`redact_url`: a URL without the password of its userinfo and without the values
  of query parameters that carry credentials (``?password=``, ``?api-key=``, ...), for
  ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``http(s)://``;
- :func:`url_host`: only the host (and port) of a URL, for attributes such as
  OpenTelemetry's ``server.address``;
- :func:`register_secret`, :func:`header_secrets` and :class:`Secret`: the process's
  registry of secrets it was handed (API keys, credential header values, values the user
  marks), redacted from every output from then on;
- :func:`url_secrets`, :func:`secret_values`: the secrets a URL carries, and those of
  the environment;
- :class:`RedactingFormatter`: a ``logging.Formatter`` whose every line, traceback
  included, goes through :func:`redact` (the command line's log handlers use it);
- :class:`RedactingFilter`: a ``logging.Filter`` that redacts each record's message,
  for another library's logger whose records we do not format (httpx logs each
  request's URL, ``?api-key=`` included).

NOTE [Redaction]
What is masked, in any output:

- URLs (``http(s)://``, ``redis(s)://``, ``unix://``, ``redis+sentinel://``): the
  password of the userinfo and the value of every query parameter with a credential
  name, shown as ``***``;
- the secrets: the values of the environment's secret-looking variables (``*KEY*``,
  ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``), of 8 characters or more,
  and every secret registered in this process (a model client's API key and the
  credentials of its base URL and its headers, a :class:`Secret`), shown as
  ``[redacted]``, in the forms servers echo them:
  as given, upper- or lower-cased, split by whitespace, percent-encoded; and for a
  key-like secret (16 or more letters, digits, ``-`` and ``_``, with both letters and
  digits) also without its provider prefix (``sk-``, ``sk-ant-api03-``, ``ghp_``...) and
  by a long enough part of its start or end (a server that cuts it short or masks its
  middle); the rest of the word a match sits in goes with it;
- shapes that are credentials wherever they come from: ``Bearer`` tokens and ``sk-...``
  keys.

A secret shorter than 8 characters is not looked for everywhere (it would take ordinary
words with it): it is masked where its place says it is one, in a URL, under a
credential name in a job's ``config`` (``redact_data(by_name=True)``), and in the
messages of the model client it was given to (its key, its URL's password, its
credential headers), which passes it to :func:`redact` (``secrets=``: masked exactly).
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

__all__ = [
    "REDACTED",
    "RedactingFilter",
    "RedactingFormatter",
    "Secret",
    "header_secrets",
    "redact",
    "redact_data",
    "redact_url",
    "register_secret",
    "registered_secrets",
    "secret_name",
    "secret_values",
    "url_host",
    "url_secrets",
]

REDACTED = "[redacted]"
MASK = "***"
MIN_FORMS = 8
"""A secret this long or longer is masked in every form; a shorter one is not registered,
and masked exactly where it is passed to :func:`redact` (``secrets=``)."""

# Names of environment variables whose values are credentials (a broad net: a false hit
# only adds a value to mask).
_SECRET_VARIABLE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# One word of a query parameter, header or configuration name that makes it a credential
# (``max_tokens`` is a count: "tokens" is not such a word, "token" is).
_SECRET_WORD = re.compile(
    r"keys?|pwd|pass|passphrase|sig|auth|authorization|bearer|sas|"
    r"[a-z0-9]*(?:token|secrets?|passw(?:or)?ds?|credentials?|signature|cookies?|apikey|"
    r"accesskey|privatekey|secretkey)"
)
_SECRET_SHAPES = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}|\bsk-[A-Za-z0-9_-]{12,}")
# scheme://user:PASSWORD@ (any characters up to the last '@' of the URL but a MASK).
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:?#]*:)(?!\*\*\*@)(.*)@(?=[^@]*$)", re.I)
_URL = re.compile(r"\b(?:rediss?|unix|redis\+sentinel|redis\+cluster|https?)://[^\s'\"<>]+")
# A key-like secret, its provider prefix, and the characters of the word a match sits in.
_KEY_LIKE = re.compile(r"(?=.*[0-9])(?=.*[A-Za-z])[A-Za-z0-9_-]{16,}")
_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9]{0,7}[-_]")
_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_PART = 12  # characters of a key-like secret's start or end that give it away


def secret_name(name: str) -> bool:
    """True when ``name`` (a query parameter, a header, a configuration key) names a
    credential: one of its words (split at ``-``, ``_``, ``.``, spaces and camelCase) is
    ``key``, ``token``, ``secret``, ``password``, ``auth``, ``authorization``,
    ``signature``, ``sig``, ``cookie``, ``credential``, ``apikey``... ``api-key``,
    ``x-api-key``, ``Authorization``, ``sentinel_password`` and ``accessToken`` do;
    ``max_tokens``, ``keyword`` and ``author`` do not."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name).lower()
    return any(_SECRET_WORD.fullmatch(word) for word in re.split(r"[^a-z0-9]+", spaced) if word)


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
        if any(secret_name(name) for name, _ in pairs):
            query = urlencode(
                [(name, MASK if secret_name(name) else value) for name, value in pairs],
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
    found += [value for name, value in parse_qsl(parts.query) if secret_name(name)]
    return list(dict.fromkeys(value for value in found if value))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the environment's secret-looking variables (8 characters or more),
    longest first (so a key that contains another is replaced whole)."""
    env = os.environ if environ is None else environ
    found = {
        value
        for name, value in env.items()
        if _SECRET_VARIABLE.search(name) and len(value) >= MIN_FORMS
    }
    return sorted(found, key=len, reverse=True)


# -- the registry --------------------------------------------------------------------------
# The secrets this process was handed (API keys, credential headers, marked values). A
# process-wide set, like the environment it extends, not a contextvar: a key given to a
# model in one task must stay out of the call log another task writes.
_registered: set[str] = set()
_registry_lock = threading.Lock()


def register_secret(value: str) -> None:
    """Mask ``value`` in every output of this process from now on, in every form of NOTE
    [Redaction]. A value under 8 characters is ignored: masked everywhere, it would take
    ordinary words with it. Model clients register their API keys and credential headers;
    call it for a secret asyncgraph cannot see (one a ``forward`` reads from a vault)."""
    if not isinstance(value, str):
        raise TypeError(f"register_secret takes a str, got {type(value).__name__}")
    if len(value) >= MIN_FORMS:
        with _registry_lock:
            _registered.add(str(value))


def registered_secrets() -> list[str]:
    """The secrets registered in this process, longest first."""
    with _registry_lock:
        return sorted(_registered, key=len, reverse=True)


class Secret(str):
    """A string that is a credential: registered when made (``register_secret``), so it
    is masked in every output of the process, and shown as ``Secret('***')`` by ``repr``.
    It is still the string itself wherever it is used.

    Mark a header whose name does not say it holds a credential (those that do, such as
    ``Authorization``, ``api-key`` or ``X-Api-Key``, are masked anyway), or a value of a
    job's ``config``. Raises ``ValueError`` for a value under 8 characters: masked
    everywhere, it would take ordinary words with it.

    Example::

        tenant_pass = os.environ.get("TENANT_PASS", "tp-9Qx2Lm7Vz4")
        model = OpenAIChat("gpt-4o-mini", headers={"X-Tenant-Pass": Secret(tenant_pass)})
        print(repr(Secret(tenant_pass)))    # Secret('***')
    """

    __slots__ = ()

    def __new__(cls, value: str) -> Secret:
        if not isinstance(value, str):
            raise TypeError(f"Secret takes a str, got {type(value).__name__}")
        if len(value) < MIN_FORMS:
            raise ValueError(
                f"a Secret needs {MIN_FORMS} characters or more, got {len(value)}: a shorter "
                f"one, masked everywhere, would take ordinary words with it (a credential "
                f"header, a URL's password and a config value under a credential name are "
                f"masked where they stand without it)"
            )
        secret = super().__new__(cls, value)
        register_secret(str(secret))
        return secret

    def __repr__(self) -> str:
        return "Secret('***')"


def header_secrets(headers: Mapping[str, str]) -> list[str]:
    """The credentials in HTTP ``headers``: the value of every header whose name says it
    holds one (``Authorization``, ``Proxy-Authorization``, ``api-key``, ``X-Api-Key``,
    ``Ocp-Apim-Subscription-Key``, ``Cookie``, any ``*-token``...) or that is a
    :class:`Secret`; of ``Bearer T`` / ``Basic B`` also ``T``, ``B`` decoded
    (``user:password``) and the password; of a cookie each of its values."""
    found: list[str] = []
    for name, value in headers.items():
        if not isinstance(value, str) or not (isinstance(value, Secret) or secret_name(name)):
            continue
        value = str(value).strip()
        found.append(value)
        scheme, _, credential = value.partition(" ")
        credential = credential.strip()
        if credential and scheme.isalpha():
            found.append(credential)
            if scheme.lower() == "basic":
                try:
                    decoded = base64.b64decode(credential, validate=True).decode()
                except (binascii.Error, UnicodeDecodeError):
                    decoded = ""
                found += [decoded, decoded.partition(":")[2]]
        if "cookie" in name.lower():
            found += [part.partition("=")[2].strip() for part in value.split(";")]
    return list(dict.fromkeys(item for item in found if item))


# -- matching a secret in the forms servers echo it ---------------------------------------


def _loose(text: str) -> str:
    """A pattern for ``text`` with any whitespace between its characters."""
    return r"\s*".join(re.escape(char) for char in text if not char.isspace())


def _core(secret: str) -> str:
    """A key-like secret without its provider prefix (``sk-``, ``sk-ant-api03-``, ``ghp_``),
    when what is left has ``_PART`` characters or more; else the secret."""
    for count in (3, 2, 1):  # the longest prefix that leaves such a core
        prefix = re.match(f"(?:{_PREFIX.pattern}){{{count}}}", secret)
        if prefix is not None and len(secret) - prefix.end() >= _PART:
            return secret[prefix.end() :]
    return secret


class _Matcher(NamedTuple):
    pattern: re.Pattern[str] | None
    """The forms of the long secrets, each alternative a named group: ``fN`` a secret
    whole, ``hN`` a key-like one's core from its start (as much as is there), ``tN`` the
    end of its core (what comes before it is matched back by ``_back``)."""
    before: dict[str, str]
    """For each ``tN``: the characters of the core before its end."""
    short: tuple[str, ...]
    """The short secrets, masked exactly."""


@functools.lru_cache(maxsize=64)
def _matcher(secrets: tuple[str, ...]) -> _Matcher:
    alternatives: dict[str, str] = {}
    before: dict[str, str] = {}
    short = tuple(s for s in secrets if len(s) < MIN_FORMS)
    forms = {form for s in secrets if len(s) >= MIN_FORMS for form in (s, quote(s, safe=""))}
    for n, form in enumerate(sorted(forms, key=len, reverse=True)):
        alternatives[f"f{n}"] = _loose(form)
        if _KEY_LIKE.fullmatch(form):
            core = _core(form)
            part = min(_PART, len(core) // 2)
            more = ""  # the rest of the core after its start, each next character optional
            for char in reversed(core[part:]):
                more = rf"(?:\s*{re.escape(char)}{more})?"
            alternatives[f"h{n}"] = _loose(core[:part]) + more
            alternatives[f"t{n}"] = _loose(core[-part:])
            before[f"t{n}"] = core[:-part]
    alternatives = {name: body for name, body in alternatives.items() if body}
    if not alternatives:
        return _Matcher(None, before, short)
    pattern = "|".join(f"(?P<{name}>{body})" for name, body in alternatives.items())
    return _Matcher(re.compile(pattern, re.IGNORECASE), before, short)


def _back(text: str, start: int, chars: str) -> int:
    """Where ``chars`` (any whitespace between them, any case) end at ``start`` in
    ``text``: the earliest index of as many of their last characters as are there."""
    for char in reversed(chars.lower()):
        i = start
        while i > 0 and text[i - 1].isspace():
            i -= 1
        if i == 0 or text[i - 1].lower() != char:
            break
        start = i - 1
    return start


def _mask_secrets(text: str, secrets: tuple[str, ...]) -> str:
    matcher = _matcher(secrets)
    if matcher.pattern is not None:
        spans: list[list[int]] = []
        for match in matcher.pattern.finditer(text):
            start, end = match.span()
            if match.lastgroup in matcher.before:
                start = _back(text, start, matcher.before[match.lastgroup])
            # The rest of the word goes too: a prefix, the part of a key a match left.
            while start > 0 and text[start - 1] in _WORD_CHARS:
                start -= 1
            while end < len(text) and text[end] in _WORD_CHARS:
                end += 1
            spans.append([start, end])
        if spans:
            pieces, last = [], 0
            for start, end in sorted(spans):
                if start < last:  # within the previous one (a match walked back into it)
                    if end > last:
                        last = end
                    continue
                pieces += [text[last:start], REDACTED]
                last = end
            text = "".join([*pieces, text[last:]])
    for secret in matcher.short:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _known(secrets: Iterable[str] | None) -> tuple[str, ...]:
    """Every secret to mask: the environment's, the registered ones and ``secrets``."""
    extra = [] if secrets is None else [s for s in secrets if s]
    return tuple(sorted({*secret_values(), *registered_secrets(), *extra}))


def _redact_with(text: str, known: tuple[str, ...]) -> str:
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _mask_secrets(text, known)
    return _SECRET_SHAPES.sub(lambda m: (m.group(1) or "") + REDACTED, text)


def redact(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with its URLs redacted (``redact_url``), the environment's secrets, the
    registered ones and those of ``secrets`` replaced by ``[redacted]`` in the forms of
    NOTE [Redaction], and bearer tokens and ``sk-...`` keys masked.

    Example::

        register_secret("sk-proj-4f9Qa8ZkT2mX7cV1bN3dR6hJ")
        print(redact("invalid key 4F9QA8ZKT2MX 7CV1BN3DR6HJ"))    # invalid key [redacted]
    """
    return _redact_with(text, _known(secrets))


def redact_data(value: Any, secrets: Iterable[str] | None = None, *, by_name: bool = False) -> Any:
    """JSON data (maps, lists, tuples, strings, numbers) with every string, map keys
    included, passed through :func:`redact`; other values are returned as they are.

    With ``by_name=True`` (a job's ``config``, which may hold ``{"api_key": ...}``), every
    string under a key that names a credential (``secret_name``) is ``***`` too, however
    short, along with the strings of the maps and lists under it.

    Example::

        redact_data({"base_url": "http://u:pw@h/v1?api-key=K", "token": "t1"}, by_name=True)
        # {'base_url': 'http://u:***@h/v1?api-key=***', 'token': '***'}
    """
    known = _known(secrets)

    def walk(item: Any, masked: bool) -> Any:
        if isinstance(item, str):
            return MASK if masked else _redact_with(item, known)
        if isinstance(item, Mapping):
            return {
                walk(key, False): walk(
                    v, masked or (by_name and isinstance(key, str) and secret_name(key))
                )
                for key, v in item.items()
            }
        if isinstance(item, (list, tuple)):
            return [walk(v, masked) for v in item]
        return item

    return walk(value, False)


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
