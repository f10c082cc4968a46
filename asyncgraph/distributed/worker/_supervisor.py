"""``asyncgraph worker --processes N``: N worker processes, restarted when they die.

The supervisor starts each child as ``python -m asyncgraph worker ... --processes 1``
(the Redis URL, which may hold a password, and the secret travel in the
environment, never in argv, which other users of the machine can read), restarts
one that exits (with a growing pause if it keeps dying at start), forwards
SIGTERM / SIGINT so the children drain their tasks, and serves the health
probes and ``/metrics`` for all of them: children write snapshots of their
metrics and health to a private directory once a second; the supervisor sums
the metrics, and is ready (``/readyz``, ``/healthz``) only when every child is
alive and reports itself ready (Redis reachable, not draining). ``/livez``
answers 200 as long as the supervisor runs.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from asyncgraph.distributed.worker._health import serve_health
from asyncgraph.distributed.worker._metrics import (
    Metrics,
    merge_snapshots,
    process_metrics,
    read_health,
    render,
)

__all__ = ["Supervisor", "child_command"]

log = logging.getLogger("asyncgraph.distributed.worker")

_REPORT_MAX_AGE_S = 5.0  # a child's health report older than this counts as not ready


class Supervisor:
    """Runs ``processes`` copies of ``child_argv`` (plus ``--metrics-dir``) until signalled.

    Example::

        supervisor = Supervisor(
            [sys.executable, "-m", "asyncgraph", "worker", "--import", "myfunctions"], processes=4
        )
        exit_code = await supervisor.run()    # until SIGTERM / SIGINT, then drains the children
    """

    def __init__(
        self,
        child_argv: Sequence[str],
        processes: int,
        *,
        env: dict[str, str] | None = None,
        drain_timeout_s: float = 30.0,
        health_host: str = "127.0.0.1",
        health_port: int | None = None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes!r}")
        self.child_argv = list(child_argv)
        self.processes = processes
        self.env = dict(os.environ if env is None else env)
        self.drain_timeout_s = drain_timeout_s
        self.health_host = health_host
        self.health_port = health_port
        self.metrics = Metrics()
        self._children: dict[int, anyio.abc.Process] = {}
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="asyncgraph-metrics-")

    async def run(self) -> int:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._signals, tg.cancel_scope)
                if self.health_port is not None:
                    await tg.start(
                        functools.partial(
                            serve_health,
                            self.health_host,
                            self.health_port,
                            self.health,
                            self.render_metrics,
                            live=self.liveness,
                        )
                    )
                async with anyio.create_task_group() as children:
                    for slot in range(self.processes):
                        children.start_soon(self._keep_alive, slot)
                tg.cancel_scope.cancel()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        return 0

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: every child alive and ready by its own last report."""
        alive = {slot: p.pid for slot, p in self._children.items() if p.returncode is None}
        children = []
        for pid in sorted(alive.values()):
            ready, status = read_health(Path(self._dir), pid, _REPORT_MAX_AGE_S)
            children.append({"pid": pid, "ready": ready, "status": status})
        not_ready = [c for c in children if not c["ready"]]
        ok = len(alive) == self.processes and not not_ready and not self._stopping
        if self._stopping:
            status = "stopping"
        elif len(alive) < self.processes:
            status = "degraded"
        elif not_ready:
            status = f"not ready: {not_ready[0]['status']}"
        else:
            status = "ok"
        return ok, {
            "status": status,
            "processes": self.processes,
            "alive": len(alive),
            "ready": len(children) - len(not_ready),
            "pids": sorted(alive.values()),
            "children": children,
            "restarts": int(self.metrics.get("asyncgraph_worker_restarts_total")),
        }

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the supervisor answers (it restarts its children itself)."""
        alive = sum(1 for p in self._children.values() if p.returncode is None)
        return True, {"status": "alive", "processes": self.processes, "alive": alive}

    def render_metrics(self) -> str:
        live = {str(p.pid) for p in self._children.values() if p.returncode is None}
        values: dict[Any, Any] = dict(merge_snapshots(Path(self._dir).glob("*.json"), live))
        self.metrics.set("asyncgraph_worker_processes", len(live))
        values.update(self.metrics.values)
        # The process series cover the whole service: the supervisor and its live children.
        for pid in [*live, "self"]:
            for key, value in process_metrics(pid).items():
                values[key] = (
                    value
                    if key[0] == "process_start_time_seconds"
                    else (values.get(key, 0) + value)
                )
        return render(values)

    async def _keep_alive(self, slot: int) -> None:
        pause = 0.5
        while not self._stopping:
            started = time.monotonic()
            argv = [
                *self.child_argv,
                "--metrics-dir",
                self._dir,
                "--supervisor-pid",
                str(os.getpid()),
            ]
            # Own session: a terminal's Ctrl-C reaches the supervisor only, which forwards
            # SIGTERM once, so the children drain instead of stopping at a second signal.
            process = await anyio.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
                env=self.env,
                start_new_session=True,
            )
            self._children[slot] = process
            log.info("supervisor: worker %d started (pid %d)", slot, process.pid)
            try:
                code = await process.wait()
            finally:
                if process.returncode is None:  # we are being cancelled: do not orphan it
                    with anyio.CancelScope(shield=True):
                        await _stop(process, self.drain_timeout_s)
            if self._stopping:
                return
            self.metrics.inc("asyncgraph_worker_restarts_total")
            quick = time.monotonic() - started < 5.0
            pause = min(pause * 2, 10.0) if quick else 0.5
            log.warning(
                "supervisor: worker %d (pid %d) exited with code %s; restarting in %.1fs",
                slot,
                process.pid,
                code,
                pause if quick else 0.0,
            )
            if quick:
                await anyio.sleep(pause)

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._stopping:
                    scope.cancel()  # second signal: stop now (children are killed)
                    return
                log.info(
                    "supervisor: %s, draining %d worker(s)",
                    signal.Signals(signum).name,
                    len(self._children),
                )
                self._stopping = True
                for process in self._children.values():
                    if process.returncode is None:
                        process.send_signal(signal.SIGTERM)
                with anyio.move_on_after(self.drain_timeout_s + 5.0):
                    for process in list(self._children.values()):
                        await process.wait()
                for process in self._children.values():
                    if process.returncode is None:
                        process.kill()


async def _stop(process: anyio.abc.Process, drain_timeout_s: float) -> None:
    process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(drain_timeout_s + 5.0):
        await process.wait()
        return
    process.kill()
    await process.wait()


def child_command() -> list[str]:
    return [sys.executable, "-m", "asyncgraph", "worker"]
