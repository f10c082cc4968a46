"""The service's settings, read from ``ASYNCGRAPH_*`` environment variables.

=============================  ===========================  ==================================
variable                       default                      meaning
=============================  ===========================  ==================================
ASYNCGRAPH_REDIS_URL           (required)                   redis://, rediss://, user:pass@...
ASYNCGRAPH_QUEUE               grads                        queue served
ASYNCGRAPH_IMPORTS             workers.functions            comma-separated function modules
ASYNCGRAPH_CONCURRENCY         64                           tasks per process at once
ASYNCGRAPH_PROCESSES           1                            worker processes (supervised)
ASYNCGRAPH_SECRET              (none)                       shared HMAC secret, >= 16 bytes
ASYNCGRAPH_LEASE_MS            10000                        reclaim silent tasks after this
ASYNCGRAPH_MAX_ATTEMPTS        3                            deliveries before dead-lettering
ASYNCGRAPH_DRAIN_TIMEOUT_S     30                           on SIGTERM, time to finish tasks
ASYNCGRAPH_HEALTH_PORT         9100                         /healthz and /metrics ("" = off)
ASYNCGRAPH_BACKEND             asyncio                      asyncio or trio
ASYNCGRAPH_LOG_LEVEL           INFO                         logging level
=============================  ===========================  ==================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings"]

DEFAULT_IMPORTS = ("workers.functions",)


@dataclass(frozen=True)
class Settings:
    redis_url: str
    queue: str = "grads"
    imports: tuple[str, ...] = DEFAULT_IMPORTS
    concurrency: int = 64
    processes: int = 1
    secret: str | None = None
    lease_ms: int = 10_000
    max_attempts: int = 3
    drain_timeout_s: float = 30.0
    health_port: int | None = 9100
    backend: str = "asyncio"
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Read the settings; ``ValueError`` names the variable that is missing or wrong."""

        def get(name: str) -> str | None:
            value = env.get(f"ASYNCGRAPH_{name}", "").strip()
            return value or None

        def number(name: str, default: float, kind: type[int] | type[float] = int) -> float:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"ASYNCGRAPH_{name} must be a number, got {raw!r}") from None
            if value <= 0:
                raise ValueError(f"ASYNCGRAPH_{name} must be positive, got {raw!r}")
            return value

        url = get("REDIS_URL")
        if url is None:
            raise ValueError("ASYNCGRAPH_REDIS_URL is required (e.g. redis://redis:6379/0)")
        imports = tuple(m.strip() for m in (get("IMPORTS") or "").split(",") if m.strip())
        port = env.get("ASYNCGRAPH_HEALTH_PORT", "9100").strip()
        backend = get("BACKEND") or "asyncio"
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"ASYNCGRAPH_BACKEND must be asyncio or trio, got {backend!r}")
        return cls(
            redis_url=url,
            queue=get("QUEUE") or "grads",
            imports=imports or DEFAULT_IMPORTS,
            concurrency=int(number("CONCURRENCY", 64)),
            processes=int(number("PROCESSES", 1)),
            secret=get("SECRET"),
            lease_ms=int(number("LEASE_MS", 10_000)),
            max_attempts=int(number("MAX_ATTEMPTS", 3)),
            drain_timeout_s=float(number("DRAIN_TIMEOUT_S", 30.0, float)),
            health_port=int(port) if port else None,
            backend=backend,
            log_level=get("LOG_LEVEL") or "INFO",
        )

    def argv(self) -> list[str]:
        """The ``asyncgraph worker`` arguments (the secret stays in the environment)."""
        args = ["--redis", self.redis_url, "--queue", self.queue,
                "--concurrency", str(self.concurrency), "--processes", str(self.processes),
                "--lease-ms", str(self.lease_ms), "--max-attempts", str(self.max_attempts),
                "--drain-timeout-s", str(self.drain_timeout_s), "--backend", self.backend,
                "--log-level", self.log_level]
        for module in self.imports:
            args += ["--import", module]
        if self.health_port is not None:
            args += ["--health-port", str(self.health_port)]
        return args
