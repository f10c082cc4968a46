"""rediss:// for real: a TLS endpoint with certificate verification on (issue #15 point 3).

The redis-server of the suite is built without TLS, so the test puts a TLS-terminating
proxy in front of it (stunnel's job, in Python): the client, a worker, the rate limiter
and the cache all speak TLS to it and verify its certificate against a test CA.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import agdist_functions as F
import pytest
from agdist_helpers import StartWorker, check_limiter_and_cache

from asyncgraph import Parameter, RemoteConnectionError, backward
from asyncgraph.distributed import open_redis_executor
from asyncgraph.resp import Pool, RedisConnectionLost, parse_redis_url

trustme = pytest.importorskip("trustme")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class TLSProxy:
    """Accepts TLS on 127.0.0.1:<port> (a certificate for 127.0.0.1 and localhost) and
    forwards the decrypted bytes to the plain Redis at ``target``."""

    def __init__(self, target: tuple[str, int], cert: object, client_ca: object = None) -> None:
        self.target = target
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self.context)  # type: ignore[attr-defined]
        if client_ca is not None:  # clients must show a certificate this CA signed
            self.context.verify_mode = ssl.CERT_REQUIRED
            client_ca.configure_trust(self.context)  # type: ignore[attr-defined]
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()  # a client that did not trust us: nothing to forward
            return
        upstream = socket.create_connection(self.target)
        done = threading.Event()

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while chunk := src.recv(65536):
                    dst.sendall(chunk)
            except OSError:
                pass
            finally:
                done.set()

        threading.Thread(target=pipe, args=(upstream, tls), daemon=True).start()
        pipe(tls, upstream)
        done.wait(5)
        for sock in (tls, upstream):
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.fixture
def tls(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(a rediss:// URL through the proxy, the CA file that verifies it)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    address = parse_redis_url(redis_url)
    proxy = TLSProxy((address.host, address.port), cert)
    yield f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={ca_file}", ca_file
    proxy.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_pass_runs_over_verified_tls_and_a_wrong_ca_is_refused(
    tls: tuple[str, Path], redis_url: str, start_worker: StartWorker, tmp_path: Path
) -> None:
    url, _ = tls
    start_worker(url, "tls", env={"AGDIST_REDIS_URL": redis_url})
    x = Parameter(1.5)
    async with open_redis_executor(url, queue="tls", timeout_s=20) as ex:
        await backward(F.Scale.apply(x, 2.0), executor=ex)
    assert x.grad is not None and x.grad.data == 2.0

    await check_limiter_and_cache(url, "tls")

    other = trustme.CA()  # a CA that did not sign the proxy's certificate
    wrong = tmp_path / "other.pem"
    other.cert_pem.write_to_path(str(wrong))
    bad_url = url.split("?", 1)[0] + f"?ssl_ca_certs={wrong}"
    with pytest.raises(RemoteConnectionError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
        async with open_redis_executor(bad_url, queue="tls", timeout_s=5, redis_timeout_s=3):
            pass


@pytest.fixture
def mutual_tls(redis_url: str, tmp_path: Path) -> Iterator[tuple[int, dict[str, Path]]]:
    """(the port of a TLS proxy whose certificate names localhost only and which wants a
    client certificate, the files: ca, certfile, keyfile)."""
    ca = trustme.CA()
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "certfile", "keyfile")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    client = ca.issue_cert("client.example")
    client.cert_chain_pems[0].write_to_path(str(files["certfile"]))
    client.private_key_pem.write_to_path(str(files["keyfile"]))
    address = parse_redis_url(redis_url)
    proxy = TLSProxy((address.host, address.port), ca.issue_cert("localhost"), client_ca=ca)
    yield proxy.port, files
    proxy.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_client_certificate_and_host_name_options_are_honoured(
    mutual_tls: tuple[int, dict[str, Path]],
) -> None:
    port, files = mutual_tls
    ca = f"ssl_ca_certs={files['ca']}"
    cert = f"ssl_certfile={files['certfile']}&ssl_keyfile={files['keyfile']}"

    async def ping(url: str) -> object:
        pool = Pool(parse_redis_url(url), timeout_s=5)
        try:
            return await pool.execute("PING")
        finally:
            await pool.aclose()

    # With its client certificate, to the name on the server's: served.
    assert await ping(f"rediss://localhost:{port}/0?{ca}&{cert}") == b"PONG"
    # Without one: the proxy closes the connection during or after the handshake.
    with pytest.raises(RedisConnectionLost):
        await ping(f"rediss://localhost:{port}/0?{ca}")
    # To 127.0.0.1, which the server's certificate does not name: refused, unless the
    # URL says not to check the host name.
    with pytest.raises(RedisConnectionLost, match=r"CERTIFICATE_VERIFY_FAILED|match"):
        await ping(f"rediss://127.0.0.1:{port}/0?{ca}&{cert}")
    unchecked = f"rediss://127.0.0.1:{port}/0?{ca}&{cert}&ssl_check_hostname=false"
    assert await ping(unchecked) == b"PONG"
