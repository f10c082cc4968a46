"""A tiny HTTP endpoint: health probes (JSON, 200 or 503) and ``GET /metrics`` (Prometheus).

- ``/livez``: liveness. 200 while the process and its event loop answer; not
  tied to Redis, so an orchestrator does not restart workers because Redis is
  down (they reconnect by themselves).
- ``/readyz`` and ``/healthz``: readiness. 200 when the worker can take tasks:
  connected to Redis, Redis answering lately, not draining (under a supervisor:
  every child process alive and ready); 503 otherwise, with the reason.

Serves one short request per connection (HTTP/1.0 style), each bounded by a
deadline, inside the worker's own task group.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

__all__ = ["serve_health"]

log = logging.getLogger("asyncgraph.distributed.worker")

_REQUEST_TIMEOUT_S = 5.0
_MAX_REQUEST = 8192


async def serve_health(
    host: str,
    port: int,
    health: Callable[[], tuple[bool, dict[str, Any]]],
    metrics: Callable[[], str],
    *,
    live: Callable[[], tuple[bool, dict[str, Any]]] | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started(port)`` reports the bound port.

    ``health`` answers readiness (``/readyz``, ``/healthz``), ``live`` liveness
    (``/livez``; default: always alive).
    """
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    sockname = listener.extra(anyio.abc.SocketAttribute.local_port)
    task_status.started(sockname)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(_REQUEST_TIMEOUT_S):
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < _MAX_REQUEST:
                        request += await stream.receive(4096)
                    line = request.split(b"\r\n", 1)[0].decode("latin-1").split()
                    path = line[1] if len(line) >= 2 else "/"
                    if path.startswith("/livez"):
                        ok, detail = live() if live is not None else (True, {"status": "alive"})
                        await _respond(
                            stream, 200 if ok else 503, "application/json", json.dumps(detail)
                        )
                    elif path.startswith("/healthz") or path.startswith("/readyz"):
                        ok, detail = health()
                        await _respond(
                            stream, 200 if ok else 503, "application/json", json.dumps(detail)
                        )
                    elif path.startswith("/metrics"):
                        await _respond(stream, 200, "text/plain; version=0.0.4", metrics())
                    else:
                        await _respond(
                            stream, 404, "text/plain", "try /livez, /readyz, /healthz or /metrics\n"
                        )
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass

    async with listener:
        await listener.serve(handle)


async def _respond(
    stream: anyio.abc.SocketStream, status: int, content_type: str, body: str
) -> None:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    data = body.encode()
    head = (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    await stream.send(head + data)
