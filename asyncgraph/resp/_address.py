"""Where a Redis is and how to reach it: ``parse_redis_url`` reads a URL into a
``RedisAddress`` (one node, a Unix socket, TLS, a Sentinel service or a Cluster's seeds).

Without redis-py: ``asyncgraph worker --help`` and every worker start parse a URL, and
redis-py costs tens of milliseconds to import; ``_url_parts`` reads a URL as redis-py's
``parse_url`` does (a test holds the two together). The query's options are checked by
``_url_options`` (see NOTE [Redis URL options]).
"""

from __future__ import annotations

import contextlib
import ssl
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from asyncgraph._redact import redact_url
from asyncgraph.resp._url_options import tls_context, url_options

__all__ = ["URL_SCHEMES", "RedisAddress", "parse_redis_url"]


@dataclass(frozen=True)
class RedisAddress:
    """Where and how to connect; from ``parse_redis_url``."""

    display: str
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr or a log
    ssl_context: ssl.SSLContext | None = None
    # redis+sentinel://: the sentinels to ask for the master of ``service`` (host and port
    # above are unused then), and the sentinels' own password if they have one.
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    # redis+cluster://: some nodes of a Redis Cluster (the seeds); host and port are unused.
    cluster: tuple[tuple[str, int], ...] = ()


URL_SCHEMES = (
    "redis://, rediss:// (TLS), unix://, redis+sentinel://, redis+cluster://, rediss+cluster://"
)


def parse_redis_url(url: str) -> RedisAddress:
    """``redis://[user:pass@]host[:port][/db]``, ``rediss://...`` (TLS, ``?ssl_cert_reqs=``
    ``none|optional|required``, ``ssl_ca_certs=``, ``ssl_ca_path=``, ``ssl_certfile=``,
    ``ssl_keyfile=``, ``ssl_password=``, ``ssl_check_hostname=``),
    ``unix:///path?db=N``, ``redis+sentinel://[user:pass@]host:port[,host:port...]/SERVICE[/db]``
    (``?sentinel_password=``; the password is the master's), or
    ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster://`` with the
    TLS options above): some nodes of a Redis Cluster. ``?password=`` and ``?username=``
    as well, but not on Sentinel. Raise ``ValueError`` for anything else: an option the scheme does
    not honour (a TLS option on ``redis://``, any on ``redis+sentinel://``), one it does
    not know, a TLS file that cannot be read (see NOTE [Redis URL options]).

    Example::

        address = parse_redis_url("redis://:secret@127.0.0.1:6380/2")
        print(address.host, address.port, address.db, address.display)   # 127.0.0.1 6380 2 redis://:***@...
    """
    if url.startswith("redis+sentinel://"):
        return _parse_sentinel_url(url)
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        return _parse_cluster_url(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: it must start with one of {URL_SCHEMES}"
        )
    return _parse_one(url, url)


def _url_parts(url: str) -> dict[str, Any]:
    """Host, port, socket path, db and credentials of a ``redis://``, ``rediss://`` or
    ``unix://`` URL, read as redis-py's ``parse_url`` reads them (percent-decoded; the db
    from ``?db=`` or else the path), without importing redis-py (see the module's
    docstring). The query's other options are ``url_options``'."""
    parts = urlsplit(url)
    kw: dict[str, Any] = {}
    query = parse_qs(parts.query)
    for name in ("username", "password"):  # the userinfo's, when given, win
        if query.get(name):
            kw[name] = query[name][0]
    if query.get("db"):
        try:
            kw["db"] = int(query["db"][0])
        except ValueError:
            raise ValueError("Invalid value for 'db' in connection URL.") from None
    if parts.username:
        kw["username"] = unquote(parts.username)
    if parts.password:
        kw["password"] = unquote(parts.password)
    if parts.scheme == "unix":
        if parts.path:
            kw["path"] = unquote(parts.path)
        return kw
    if parts.hostname:
        kw["host"] = unquote(parts.hostname)
    if parts.port:  # ValueError for a port out of range or not a number
        kw["port"] = int(parts.port)
    if parts.path and "db" not in kw:
        with contextlib.suppress(ValueError):
            kw["db"] = int(unquote(parts.path).replace("/", ""))
    return kw


def _parse_one(url: str, shown: str) -> RedisAddress:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL; errors name ``shown`` (the URL
    the user wrote, of which ``url`` may be one node)."""
    scheme = url.split("://", 1)[0]
    options = url_options(shown, scheme, urlsplit(url).query)
    try:
        kw = _url_parts(url)
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {redact_url(shown)!r}: {exc}") from None
    return RedisAddress(
        display=redact_url(url),
        host=kw.get("host", "127.0.0.1"),
        port=int(kw.get("port", 6379)),
        path=kw.get("path"),
        db=int(kw.get("db", 0) or 0),
        username=kw.get("username"),
        password=kw.get("password"),
        ssl_context=tls_context(shown, options) if scheme == "rediss" else None,
    )


def _parse_sentinel_url(url: str) -> RedisAddress:
    parts = urlsplit(url)
    sentinels = _host_ports(url, parts.netloc)
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: expected "
            f"redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/db]"
        )
    options = url_options(url, "redis+sentinel", parts.query)
    return RedisAddress(
        display=redact_url(url).split("?", 1)[0],  # no sentinel_password
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        sentinels=tuple(sentinels),
        service=path[0],
        sentinel_password=options.get("sentinel_password"),
    )


def _host_ports(url: str, netloc: str) -> list[tuple[str, int]]:
    nodes = []
    for item in filter(None, netloc.rsplit("@", 1)[-1].split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"invalid Redis URL {redact_url(url)!r}: each node must be host:port, got {item!r}"
            )
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def _parse_cluster_url(url: str) -> RedisAddress:
    scheme, rest = url.split("+cluster://", 1)
    rest, _, query = rest.partition("?")
    netloc, _, db = rest.partition("/")
    nodes = _host_ports(url, netloc)
    if not nodes or db not in ("", "0"):
        raise ValueError(
            f"invalid Redis URL {redact_url(url)!r}: expected "
            f"{scheme}+cluster://[user:password@]host:port[,host:port...] (a cluster has "
            f"database 0 only)"
        )
    url_options(url, f"{scheme}+cluster", query)  # what the cluster scheme takes
    # Credentials and TLS options as for one node (the first).
    userinfo = netloc.rsplit("@", 1)[0] + "@" if "@" in netloc else ""
    host, port = nodes[0]
    one = _parse_one(f"{scheme}://{userinfo}{host}:{port}/0" + (f"?{query}" if query else ""), url)
    return replace(one, display=redact_url(url).split("?", 1)[0], cluster=tuple(nodes))
