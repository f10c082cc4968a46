"""A local worker fleet for ``asyncgraph demo --workers N`` and the benchmarks.

Starts an embedded ``redis-server`` (unless a URL is given) and one
``asyncgraph worker --processes N`` supervisor, waits until N workers have
announced themselves, and tears everything down on exit (SIGTERM, which lets
the workers drain, then SIGKILL after a deadline).

The embedded server listens on loopback, where every local user can reach it: it
requires a random password, new each time, which only the URL the fleet yields
carries. The workers get the secret and the allowed base URLs the caller names, added
to the user's ``ASYNCGRAPH_SECRET`` / ``ASYNCGRAPH_ALLOWED_BASE_URLS``, which reach them
as they reach a worker started by hand.

The fleet must not outlive the process that started it: redis-server and the
supervisor run in their own session (a terminal's Ctrl-C reaches the demo only,
which then stops them in order) and, on Linux, with a parent-death signal
(SIGTERM when the starting thread's process dies, even by ``kill -9``).

Also here: :func:`live_workers`, how many workers of a queue sent a heartbeat
recently, so a command can refuse to start against a queue nobody serves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TypeVar

import anyio

from asyncgraph import RemoteConnectionError
from asyncgraph._exceptions import ConfigError, FleetError
from asyncgraph.distributed._liveness import live_consumers
from asyncgraph.distributed._redis_server import RedisServer
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.worker._config import SETTINGS, WorkerConfig
from asyncgraph.resp import Pool, RedisConnectionLost, ReplyError, parse_redis_url

T = TypeVar("T")

__all__ = ["FleetError", "child_setup", "live_workers", "local_fleet"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_setup() -> Callable[[], None]:
    """A ``preexec_fn`` that detaches a child from the terminal and ties it to this process.

    In the child, before exec: a new session (``setsid``: no controlling terminal,
    so a terminal's Ctrl-C is not delivered to it) and, on Linux, ``prctl(
    PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends it SIGTERM when the thread
    that started it exits, however this process dies. Start fleets from a thread
    that lives as long as they do (the main thread). If this process is already
    gone when the child gets there, the child exits at once.
    """
    parent = os.getpid()
    sigterm = int(signal.SIGTERM)
    prctl: Any = None
    if sys.platform.startswith("linux"):
        try:
            # The running program's symbols, libc's among them: no ldconfig subprocess
            # (ctypes.util.find_library runs one) before every fleet starts.
            libc = ctypes.CDLL(None, use_errno=True)
            prctl = libc.prctl
        except (OSError, AttributeError):
            prctl = None

    def setup() -> None:  # runs in the forked child: async-signal-safe calls only
        os.setsid()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the prctl took effect
                os._exit(1)

    return setup


async def _ask(url: str, queue: str, commands: list[list[Any]], timeout_s: float) -> list[Any]:
    """The replies to ``commands`` about ``queue``'s workers, in one round trip on a pool of
    its own; ``RemoteConnectionError`` when Redis does not answer or refuses one."""
    address = parse_redis_url(url)
    pool = Pool(address, timeout_s=timeout_s)
    try:
        replies = await pool.pipeline(commands, timeout_s=timeout_s)
    except RedisConnectionLost as exc:
        raise RemoteConnectionError(
            f"cannot reach Redis at {address.display} (queue {queue!r}): {exc}"
        ) from None
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
    for command, reply in zip(commands, replies, strict=True):
        if isinstance(reply, ReplyError):
            raise RemoteConnectionError(
                f"Redis at {address.display} refused {command[0]} about the workers of queue "
                f"{queue!r}: {reply}"
            )
    return replies


async def _live_set(url: str, queue: str, timeout_s: float) -> set[bytes]:
    """The live consumers of ``queue``; ``RemoteConnectionError`` when Redis does not answer."""
    keys.check_queue_name(queue)
    commands = [["TIME"], ["HGETALL", keys.workers_hash(queue)]]
    now, beats = await _ask(url, queue, commands, timeout_s)
    return live_consumers(now, beats)


async def _workers_before(url: str, queue: str, clear: bool, timeout_s: float) -> frozenset[bytes]:
    """The workers registered on ``queue`` before a fleet starts; ``clear``: delete them
    instead (a Redis of the fleet's own) and return none."""
    command = ["DEL" if clear else "HKEYS", keys.workers_hash(queue)]
    (reply,) = await _ask(url, queue, [command], timeout_s)
    return frozenset() if clear else frozenset(reply)


def _blocking(fn: Callable[..., Awaitable[T]], *args: Any, timeout_s: float) -> T:
    """``await fn(*args)`` from synchronous code, in a thread of its own: the caller may be
    inside a running event loop (``local_fleet`` in the demo), where ``anyio.run`` is not
    allowed. ``timeout_s``: the deadline ``fn`` keeps; the thread gets 5 s more."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(anyio.run(fn, *args))
        except BaseException as exc:  # handed to the caller's thread below
            result.append(exc)

    thread = threading.Thread(target=target, name="asyncgraph-fleet-redis", daemon=True)
    thread.start()
    thread.join(timeout_s + 5.0)
    if not result:
        raise RemoteConnectionError(f"Redis did not answer within {timeout_s:g}s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]  # type: ignore[no-any-return]


def wait_for_workers(
    url: str,
    queue: str,
    count: int,
    *,
    timeout_s: float = 30.0,
    proc: subprocess.Popen[bytes] | None = None,
    ignore: frozenset[bytes] = frozenset(),
) -> None:
    """Block until ``count`` live workers of ``queue``, not in ``ignore``, sent a heartbeat.

    Any URL the workers take (``redis+sentinel://`` too); it blocks the calling thread.
    Raises FleetError when the supervisor ``proc`` exits first or
    ``timeout_s`` passes.

    Example::

        supervisor = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", "worker", "--redis", url, "--import", "myfunctions"]
        )
        wait_for_workers(url, "grads", 1, proc=supervisor)    # FleetError if it exits first
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise FleetError(
                f"the worker supervisor (`asyncgraph worker --processes {count}`) exited with "
                f"code {proc.returncode} at start; run it by hand to see why"
            )
        try:
            if len(_blocking(_live_set, url, queue, 2.0, timeout_s=2.0) - ignore) >= count:
                return
        except RemoteConnectionError:
            pass  # Redis is starting, or failing over: keep waiting until the deadline
        time.sleep(0.05)
    raise FleetError(f"{count} worker(s) of queue {queue!r} did not start within {timeout_s}s")


async def live_workers(url: str, queue: str, *, timeout_s: float = 5.0) -> int:
    """How many workers of ``queue`` at ``url`` are alive (heartbeat not expired).

    The workers' heartbeat hash maps each consumer to the expiry of its last
    heartbeat, in ms of the Redis server's clock (``TIME``). Raises
    ``RemoteConnectionError`` when Redis does not answer within ``timeout_s``,
    ``ValueError`` for a bad URL or queue name.

    Example::

        print(await live_workers("redis://127.0.0.1:6379/0", "grads"))    # e.g. 2
    """
    return len(await _live_set(url, queue, timeout_s))


def _stop_supervisor(proc: subprocess.Popen[bytes], drain_s: float) -> None:
    """SIGTERM (the workers drain), then SIGKILL after ``drain_s`` or at a second Ctrl-C."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(drain_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    except KeyboardInterrupt:  # a second Ctrl-C while the workers drain: stop now
        proc.kill()
        proc.wait(5)
        raise


def _variable_name(field: str) -> str:
    """The environment variable of ``field`` (``ASYNCGRAPH_SECRET`` for ``secret``)."""
    (variable,) = (setting.variable for setting in SETTINGS if setting.field == field)
    return variable


def _variable(field: str) -> str:
    """The value of ``field``'s variable, or ""."""
    return os.environ.get(_variable_name(field), "").strip()


def _base_urls(given: Sequence[str]) -> tuple[str, ...]:
    """The environment's allowed base URLs, then ``given``, each once."""
    listed = [url.strip() for url in _variable("allowed_base_urls").split(",")]
    return tuple(dict.fromkeys(url for url in [*listed, *given] if url))


@contextmanager
def local_fleet(
    processes: int,
    imports: Sequence[str],
    *,
    redis_url: str | None = None,
    queue: str = "grads",
    concurrency: int = 128,
    extra_args: Sequence[str] = (),
    quiet: bool = True,
    drain_s: float = 30.0,
    secret: str | None = None,
    allowed_base_urls: Sequence[str] = (),
) -> Iterator[str]:
    """Run ``processes`` local workers serving ``imports``; yields the Redis URL.

    With ``redis_url`` the workers join that Redis (other workers of the queue,
    and their heartbeat entries, are left alone); without, a redis-server is
    started for the fleet, with a random password that the yielded URL carries
    (redact it before showing it). Call it from the main thread (see
    :func:`child_setup`).

    ``secret``: the workers' shared HMAC secret (at least 16 bytes; give the client
    the same one); None: ``$ASYNCGRAPH_SECRET``, or unsigned when it is unset; ``""``:
    unsigned.
    ``allowed_base_urls``: model base URLs the workers may send their API key to, on
    top of those in ``$ASYNCGRAPH_ALLOWED_BASE_URLS``. Raises ``ConfigError`` for a
    bad secret or base URL, ``FleetError`` when the fleet does not start.

    Example::

        with local_fleet(2, ["myfunctions"]) as url:
            async with open_redis_executor(url, queue="grads") as ex:
                await loss.backward(executor=ex)
    """
    keys.check_queue_name(queue)
    secret_from_env = secret is None
    if secret is None:
        secret = _variable("secret")
    try:
        config = WorkerConfig(  # checked before any process starts; the URL comes below
            redis_url=redis_url or "redis://127.0.0.1:6379/0",
            queue=queue,
            imports=tuple(imports),
            processes=processes,
            concurrency=concurrency,
            secret=secret or None,
            allowed_base_urls=_base_urls(allowed_base_urls),
        )
    except ConfigError as exc:
        if exc.field == "secret" and secret_from_env:  # name what the user wrote
            raise exc.with_name(_variable_name("secret")) from None
        raise
    with ExitStack() as stack:
        if redis_url is None:
            try:
                server = RedisServer(preexec_fn=child_setup(), password=secrets.token_hex(16))
            except FileNotFoundError as exc:  # no redis-server binary: say what to install
                raise FleetError(str(exc)) from None
            url = stack.enter_context(server).url
        else:
            url = redis_url
        # Our own Redis: start from a clean slate. Someone else's: count only the
        # workers that start now.
        already = _blocking(_workers_before, url, queue, redis_url is None, 2.0, timeout_s=2.0)
        config = dataclasses.replace(config, redis_url=url)
        args = [sys.executable, "-m", "asyncgraph", "worker", *config.to_args(), *extra_args]
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=config.child_env(),
            preexec_fn=child_setup(),
        )
        try:
            wait_for_workers(url, queue, processes, proc=proc, ignore=already)
            yield url
        finally:
            _stop_supervisor(proc, drain_s)
