"""A Redis URL's query options are honoured or refused, never ignored (#33 point 4).

``redis://:pw@host/0?ssl_ca_certs=...&ssl_cert_reqs=required`` once connected in
plaintext and sent the password in clear. The tests parse URLs, then give refused ones to
the commands and the executor against a real listener that records what reaches it.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph.distributed import open_redis_executor
from asyncgraph.resp import parse_redis_url

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


class Listener:
    """A TCP listener on 127.0.0.1 that records every connection and the bytes sent on it
    (what a plaintext Redis, or someone on the path, would read)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.received = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            try:
                while chunk := conn.recv(4096):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def test_tls_options_on_a_plaintext_scheme_are_refused_naming_the_option(ca_file: Path) -> None:
    for url, option in (
        (f"redis://:pw@h/0?ssl_ca_certs={ca_file}&ssl_cert_reqs=required", "ssl_ca_certs"),
        ("redis://:pw@h/0?ssl=true", "ssl"),
        ("redis://h/0?ssl_check_hostname=true", "ssl_check_hostname"),
        ("redis+cluster://:pw@h:7000?ssl_cert_reqs=required", "ssl_cert_reqs"),
    ):
        with pytest.raises(ValueError, match=f"'{option}' is a TLS option") as caught:
            parse_redis_url(url)
        message = str(caught.value)
        assert "connects without TLS" in message and "rediss" in message and "pw" not in message
    with pytest.raises(ValueError, match="unix:// socket has no TLS"):
        parse_redis_url(f"unix:///tmp/redis.sock?ssl_ca_certs={ca_file}")


def test_tls_through_sentinel_is_refused_not_ignored(ca_file: Path) -> None:
    for option in (f"ssl_ca_certs={ca_file}", "ssl_cert_reqs=required", "ssl=true"):
        with pytest.raises(ValueError, match="TLS through Sentinel is not supported"):
            parse_redis_url(f"redis+sentinel://:pw@a:26379,b:26380/svc?{option}")
    with pytest.raises(ValueError, match="unknown option 'password' for redis"):
        parse_redis_url("redis+sentinel://a:26379/svc?password=x")  # the master's: in userinfo
    address = parse_redis_url("redis+sentinel://a:26379/svc?sentinel_password=sp")
    assert address.sentinel_password == "sp"


def test_an_unknown_repeated_or_empty_option_is_an_error() -> None:
    for url, why in (
        ("redis://h/0?socket_timeout=5", "unknown option 'socket_timeout' for redis://"),
        ("rediss://h/0?ssl_min_version=TLSv1_3", "unknown option 'ssl_min_version'"),
        ("rediss+cluster://h:1?db=0", "unknown option 'db' for rediss+cluster://"),
        ("redis://h/0?db=1&db=2", "option 'db' is given twice"),
        ("rediss://h/0?ssl_ca_certs=", "option 'ssl_ca_certs' has no value"),
        ("redis://h/0?db=x", "db='x' is not a database number"),
    ):
        with pytest.raises(ValueError, match="invalid Redis URL") as caught:
            parse_redis_url(url)
        assert why in str(caught.value), caught.value


def test_tls_option_values_are_checked_and_contradictions_refused(ca_file: Path) -> None:
    for query, why in (
        ("ssl_cert_reqs=requird", "ssl_cert_reqs='requird': give none, optional or required"),
        ("ssl_check_hostname=maybe", "ssl_check_hostname='maybe' is not true or false"),
        ("ssl=false", "ssl=false contradicts rediss://"),
        (f"ssl_cert_reqs=none&ssl_ca_certs={ca_file}", "ssl_ca_certs has no effect"),
        ("ssl_cert_reqs=none&ssl_check_hostname=true", "ssl_check_hostname=true has no effect"),
        ("ssl_keyfile=k.pem", "ssl_keyfile without ssl_certfile"),
    ):
        with pytest.raises(ValueError, match="invalid Redis URL") as caught:
            parse_redis_url(f"rediss://h/0?{query}")
        assert why in str(caught.value), caught.value


def test_tls_options_make_the_context_they_say(ca_file: Path) -> None:
    default = parse_redis_url("rediss://h/0?ssl=true").ssl_context
    assert default is not None
    assert default.verify_mode == ssl.CERT_REQUIRED and default.check_hostname
    loose = parse_redis_url("rediss://h/0?ssl_check_hostname=false").ssl_context
    assert loose is not None and loose.verify_mode == ssl.CERT_REQUIRED
    assert not loose.check_hostname
    none = parse_redis_url("rediss://h/0?ssl_cert_reqs=NONE").ssl_context
    assert none is not None and none.verify_mode == ssl.CERT_NONE and not none.check_hostname
    ca = parse_redis_url(f"rediss://h/0?ssl_ca_certs={ca_file}").ssl_context
    assert ca is not None and len(ca.get_ca_certs()) == 1  # that CA only
    node = parse_redis_url(f"rediss+cluster://u:p@h:1,g:2?ssl_ca_certs={ca_file}")
    assert node.ssl_context is not None and len(node.ssl_context.get_ca_certs()) == 1
    assert node.cluster == (("h", 1), ("g", 2)) and (node.username, node.password) == ("u", "p")
    assert parse_redis_url("redis://u@h/3?password=pq").password == "pq"


def test_a_tls_file_that_cannot_be_read_is_one_clear_line(tmp_path: Path) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("not a certificate\n")
    for query, why in (
        ("ssl_ca_certs=/missing/ca.pem", "ssl_ca_certs='/missing/ca.pem' cannot be used: No such"),
        (f"ssl_ca_certs={not_pem}", f"ssl_ca_certs='{not_pem}' cannot be used: "),
        ("ssl_certfile=/missing/c.pem", "ssl_certfile='/missing/c.pem' cannot be used: No such"),
    ):
        with pytest.raises(ValueError, match="invalid Redis URL") as caught:
            parse_redis_url(f"rediss://h/0?{query}")
        assert why in str(caught.value), caught.value


@pytest.mark.slow
def test_each_command_says_a_tls_file_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    url = "rediss://:pw@127.0.0.1:1/0?ssl_ca_certs=/missing/ca.pem"
    for command in (["status"], ["worker", "--import", "json"], ["demo", "--out", "x"]):
        done = subprocess.run(
            [sys.executable, "-m", "asyncgraph", *command, "--redis", url],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert done.returncode in (1, 2), done
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert "ssl_ca_certs='/missing/ca.pem' cannot be used" in done.stderr, done.stderr
        assert ":pw@" not in done.stderr


@pytest.mark.slow
def test_a_refused_url_sends_nothing_to_the_server(listener: Listener, ca_file: Path) -> None:
    # What the issue saw: the URL asks for TLS, and the password went out in plaintext.
    secret = "plaintext-secret-1"
    urls = [
        f"redis://:{secret}@127.0.0.1:{listener.port}/0?ssl_ca_certs={ca_file}"
        f"&ssl_cert_reqs=required",
        f"redis+sentinel://:{secret}@127.0.0.1:{listener.port}/svc?ssl_cert_reqs=required",
    ]
    for url in urls:
        done = subprocess.run(
            [sys.executable, "-m", "asyncgraph", "status", "--redis", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert secret.encode() not in listener.received  # the password went out in clear
        assert done.returncode == 1 and done.stderr.startswith("error: invalid Redis URL")
        assert "ssl_c" in done.stderr and secret not in done.stderr
    assert listener.connections == 0 and listener.received == b""


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_executor_refuses_a_url_whose_tls_options_it_cannot_honour(
    listener: Listener, ca_file: Path
) -> None:
    url = f"redis://:pw@127.0.0.1:{listener.port}/0?ssl_ca_certs={ca_file}"
    with pytest.raises(ValueError, match="'ssl_ca_certs' is a TLS option"):
        async with open_redis_executor(url, queue="q", timeout_s=5, redis_timeout_s=2):
            pass
    assert listener.connections == 0 and listener.received == b""


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6380/2",
        "redis://:p%40ss@h/0",
        "redis://user:pw@host:6379?db=3",
        "rediss://h",
        "unix:///tmp/r.sock?db=2",
        "redis://h/abc",
        "redis://u@h",
        "redis://h:6379/",
        "unix://:pw@/tmp/x.sock",
        "redis://[::1]:6379/1",
        "redis://h/%31",
        "redis://u@h/3?password=pq",
        "redis://u:x@h/3?password=pq",
        "redis://h?username=a&password=b",
        "unix:///s?password=p&db=4",
    ],
)
def test_a_url_reads_as_redis_pys_parse_url_reads_it(url: str) -> None:
    """Our parse (no redis-py import on a command's start) agrees with redis-py's."""
    from redis.connection import parse_url

    from asyncgraph.resp._address import _url_parts

    fields = ("host", "port", "path", "db", "username", "password")
    theirs = {k: v for k, v in parse_url(url).items() if k in fields}  # type: ignore[no-untyped-call]
    assert _url_parts(url) == theirs
