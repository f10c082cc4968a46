"""The query options of a Redis URL: which each scheme takes, and the TLS they ask for.

NOTE [Redis URL options]: an option is honoured or the URL is refused, never ignored. A
security option dropped in silence is the worst case: ``redis://:pw@host/0?ssl_ca_certs=
ca.pem&ssl_cert_reqs=required`` once connected in plaintext and sent the password in
clear. So:

- each scheme has the options it honours (``SCHEME_OPTIONS``); any other, a repeated one
  or one without a value is an error naming it;
- a TLS option on ``redis://`` (or ``unix://``) is refused, not taken as a wish for TLS:
  the scheme is what says whether a connection is encrypted, and a URL that says both
  is a mistake to show, not one to guess at (``rediss://`` is the one way to TLS);
- TLS through Sentinel is not supported: its TLS options are refused, with what to do;
- a TLS file that cannot be read, or options that contradict each other
  (``ssl_cert_reqs=none`` with a CA), are errors at parse time, in one line.
"""

from __future__ import annotations

import ssl
from urllib.parse import parse_qsl

from asyncgraph._redact import redact_url

__all__ = ["SCHEME_OPTIONS", "TLS_OPTIONS", "tls_context", "url_options"]

TLS_OPTIONS = (
    "ssl",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_check_hostname",
    "ssl_keyfile",
    "ssl_password",
)
_PLAIN = ("db", "password", "username")
SCHEME_OPTIONS: dict[str, tuple[str, ...]] = {
    "redis": _PLAIN,
    "unix": _PLAIN,
    "rediss": (*_PLAIN, *TLS_OPTIONS),
    "redis+cluster": ("password", "username"),
    "rediss+cluster": ("password", "username", *TLS_OPTIONS),
    "redis+sentinel": ("sentinel_password",),
}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _invalid(url: str, why: str) -> ValueError:
    return ValueError(f"invalid Redis URL {redact_url(url)!r}: {why}")


def url_options(url: str, scheme: str, query: str) -> dict[str, str]:
    """The options of ``query`` (``url``'s, of ``scheme``) by name, each checked: raise
    ``ValueError`` naming an option the scheme does not honour (see NOTE [Redis URL
    options]), one given twice or without a value, or a value it cannot take."""
    options: dict[str, str] = {}
    allowed = SCHEME_OPTIONS[scheme]
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in allowed:
            raise _invalid(url, _not_honoured(name, scheme))
        if name in options:
            raise _invalid(url, f"option {name!r} is given twice; give it once")
        if not value:
            raise _invalid(url, f"option {name!r} has no value; give one or leave it out")
        options[name] = value
    if "db" in options and not options["db"].isdigit():
        raise _invalid(url, f"db={options['db']!r} is not a database number")
    _check_tls(url, options)
    return options


def _not_honoured(name: str, scheme: str) -> str:
    plain = scheme in ("redis", "unix", "redis+cluster")
    if name in TLS_OPTIONS and scheme == "unix":
        return f"{name!r} is a TLS option, and a unix:// socket has no TLS: leave it out"
    if name in TLS_OPTIONS and plain:
        tls = "rediss+cluster://" if scheme == "redis+cluster" else "rediss://"
        return (
            f"{name!r} is a TLS option, and {scheme}:// connects without TLS: write {tls} "
            f"to connect with TLS (asyncgraph never ignores a security option)"
        )
    if name in TLS_OPTIONS or (scheme == "redis+sentinel" and name.startswith("ssl")):
        return (
            f"{name!r}: TLS through Sentinel is not supported (asyncgraph never ignores a "
            f"security option); connect to the master with rediss://, or to the sentinels "
            f"over a network you trust"
        )
    return f"unknown option {name!r} for {scheme}:// (it takes {', '.join(SCHEME_OPTIONS[scheme])})"


def _check_tls(url: str, options: dict[str, str]) -> None:
    for name in ("ssl", "ssl_check_hostname"):
        if name in options and options[name].lower() not in (*_TRUE, *_FALSE):
            raise _invalid(url, f"{name}={options[name]!r} is not true or false")
    if "ssl" in options and options["ssl"].lower() in _FALSE:
        raise _invalid(url, "ssl=false contradicts rediss:// (TLS); write redis:// for none")
    reqs = options.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise _invalid(
            url, f"ssl_cert_reqs={options['ssl_cert_reqs']!r}: give none, optional or required"
        )
    if reqs == "none":
        check = options.get("ssl_check_hostname", "false").lower() in _TRUE
        pointless = [n for n in ("ssl_ca_certs", "ssl_ca_path") if n in options]
        if check or pointless:
            name = "ssl_check_hostname=true" if check else pointless[0]
            raise _invalid(
                url, f"{name} has no effect with ssl_cert_reqs=none (no certificate is checked)"
            )
    for name in ("ssl_keyfile", "ssl_password"):
        if name in options and "ssl_certfile" not in options:
            raise _invalid(url, f"{name} without ssl_certfile (the client certificate)")


def tls_context(url: str, options: dict[str, str]) -> ssl.SSLContext:
    """The TLS context ``options`` (checked by ``url_options``) ask for: the system's CAs,
    or ``ssl_ca_certs`` / ``ssl_ca_path``; certificates required and the host name
    checked unless they say otherwise; a client certificate from ``ssl_certfile``.
    Raise ``ValueError`` naming a file that cannot be read or used."""
    try:
        context = ssl.create_default_context(
            cafile=options.get("ssl_ca_certs"), capath=options.get("ssl_ca_path")
        )
    except OSError as exc:  # ssl.SSLError too: a file that is not PEM
        name = "ssl_ca_certs" if "ssl_ca_certs" in options else "ssl_ca_path"
        raise _invalid(url, f"{name}={options[name]!r} cannot be used: {_reason(exc)}") from None
    reqs = _CERT_REQS[options.get("ssl_cert_reqs", "required").lower()]
    if reqs == ssl.CERT_NONE:
        context.check_hostname = False
    else:
        context.check_hostname = options.get("ssl_check_hostname", "true").lower() in _TRUE
    context.verify_mode = reqs
    if "ssl_certfile" in options:
        try:
            context.load_cert_chain(
                options["ssl_certfile"], options.get("ssl_keyfile"), options.get("ssl_password")
            )
        except OSError as exc:
            files = f"ssl_certfile={options['ssl_certfile']!r}" + (
                f", ssl_keyfile={options['ssl_keyfile']!r}" if "ssl_keyfile" in options else ""
            )
            raise _invalid(url, f"{files} cannot be used: {_reason(exc)}") from None
    return context


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"{exc.reason or exc}"
    return exc.strerror or str(exc)
