"""The service's settings, read from ``ASYNCGRAPH_*`` environment variables.

==============================  ===========================  ==================================
variable                        default                      meaning
==============================  ===========================  ==================================
ASYNCGRAPH_REDIS_URL            (required)                   redis://, rediss://, user:pass@...
ASYNCGRAPH_QUEUE                grads                        queue served
ASYNCGRAPH_IMPORTS              workers.functions            comma-separated function modules
ASYNCGRAPH_CONCURRENCY          64                           tasks per process at once
ASYNCGRAPH_PROCESSES            1                            worker processes (supervised)
ASYNCGRAPH_SECRET               (none)                       shared HMAC secret, >= 16 bytes
ASYNCGRAPH_ALLOWED_BASE_URLS    (none)                       model base URLs tasks may name,
                                                             comma-separated (the default
                                                             OpenAI URL is always allowed)
ASYNCGRAPH_LEASE_MS             10000                        reclaim silent tasks after this
ASYNCGRAPH_MAX_ATTEMPTS         3                            deliveries before dead-lettering
ASYNCGRAPH_DRAIN_TIMEOUT_S      30                           on SIGTERM, time to finish tasks
ASYNCGRAPH_CONNECT_TIMEOUT_S    0                            at start, retry Redis this long
                                                             (0: until it answers)
ASYNCGRAPH_HEALTH_PORT          9100                         /livez, /readyz, /metrics ("" = off)
ASYNCGRAPH_BACKEND              asyncio                      asyncio or trio
ASYNCGRAPH_LOG_LEVEL            INFO                         logging level
==============================  ===========================  ==================================

``Settings.from_env`` checks every value (numbers, ports, URLs, the queue name, the
secret's length) and raises ``ValueError`` naming the variable; ``python -m workers
--check`` runs it, imports the function modules and builds the worker's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings"]

DEFAULT_IMPORTS = ("workers.functions",)
_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


@dataclass(frozen=True)
class Settings:
    redis_url: str
    queue: str = "grads"
    imports: tuple[str, ...] = DEFAULT_IMPORTS
    concurrency: int = 64
    processes: int = 1
    secret: str | None = None
    allowed_base_urls: tuple[str, ...] = ()
    lease_ms: int = 10_000
    max_attempts: int = 3
    drain_timeout_s: float = 30.0
    connect_timeout_s: float = 0.0
    health_port: int | None = 9100
    backend: str = "asyncio"
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:  # noqa: C901 (one check per setting; to be replaced by WorkerConfig.from_env)
        """Read and check the settings; ``ValueError`` names the variable that is missing or wrong."""
        from asyncgraph.distributed.wire._keys import check_queue_name
        from asyncgraph.models._spec import normalize_base_url
        from asyncgraph.resp._client import parse_redis_url

        def get(name: str) -> str | None:
            value = env.get(f"ASYNCGRAPH_{name}", "").strip()
            return value or None

        def integer(name: str, default: int, *, minimum: int = 1) -> int:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"ASYNCGRAPH_{name} must be an integer, got {raw!r}") from None
            if value < minimum:
                raise ValueError(f"ASYNCGRAPH_{name} must be >= {minimum}, got {raw!r}")
            return value

        def seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(
                    f"ASYNCGRAPH_{name} must be a number of seconds, got {raw!r}"
                ) from None
            if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
                bound = ">= 0" if zero_ok else "> 0"
                raise ValueError(f"ASYNCGRAPH_{name} must be {bound} and finite, got {raw!r}")
            return value

        url = get("REDIS_URL")
        if url is None:
            raise ValueError("ASYNCGRAPH_REDIS_URL is required (e.g. redis://redis:6379/0)")
        try:
            parse_redis_url(url)
        except ValueError as exc:
            raise ValueError(f"ASYNCGRAPH_REDIS_URL: {exc}") from None
        queue = get("QUEUE") or "grads"
        try:
            check_queue_name(queue)
        except ValueError as exc:
            raise ValueError(f"ASYNCGRAPH_QUEUE: {exc}") from None
        secret = get("SECRET")
        if secret is not None and len(secret.encode()) < 16:
            raise ValueError(
                "ASYNCGRAPH_SECRET must be at least 16 bytes long; generate one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        allowed = tuple(u.strip() for u in (get("ALLOWED_BASE_URLS") or "").split(",") if u.strip())
        for base_url in allowed:
            try:
                normalize_base_url(base_url)
            except ValueError as exc:
                raise ValueError(f"ASYNCGRAPH_ALLOWED_BASE_URLS: {exc}") from None
        imports = tuple(m.strip() for m in (get("IMPORTS") or "").split(",") if m.strip())
        port: int | None = None
        if env.get("ASYNCGRAPH_HEALTH_PORT", "9100").strip():
            port = integer("HEALTH_PORT", 9100, minimum=0)
            if port > 65535:
                raise ValueError(f"ASYNCGRAPH_HEALTH_PORT must be 0 to 65535, got {port}")
        backend = get("BACKEND") or "asyncio"
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"ASYNCGRAPH_BACKEND must be asyncio or trio, got {backend!r}")
        log_level = (get("LOG_LEVEL") or "INFO").upper()
        if log_level not in _LOG_LEVELS:
            raise ValueError(
                f"ASYNCGRAPH_LOG_LEVEL must be one of {', '.join(_LOG_LEVELS)}, "
                f"got {get('LOG_LEVEL')!r}"
            )
        lease_ms = integer("LEASE_MS", 10_000)
        if lease_ms < 200:
            raise ValueError(f"ASYNCGRAPH_LEASE_MS must be >= 200, got {lease_ms}")
        return cls(
            redis_url=url,
            queue=queue,
            imports=imports or DEFAULT_IMPORTS,
            concurrency=integer("CONCURRENCY", 64),
            processes=integer("PROCESSES", 1),
            secret=secret,
            allowed_base_urls=allowed,
            lease_ms=lease_ms,
            max_attempts=integer("MAX_ATTEMPTS", 3),
            drain_timeout_s=seconds("DRAIN_TIMEOUT_S", 30.0),
            connect_timeout_s=seconds("CONNECT_TIMEOUT_S", 0.0, zero_ok=True),
            health_port=port,
            backend=backend,
            log_level=log_level,
        )

    def argv(self) -> list[str]:
        """The ``asyncgraph worker`` arguments.

        The Redis URL (it may hold a password), the secret and the allowed base URLs
        are not in it: ``asyncgraph worker`` reads them from the same environment
        (``ASYNCGRAPH_REDIS_URL``, ``ASYNCGRAPH_SECRET``, ``ASYNCGRAPH_ALLOWED_BASE_URLS``).
        """
        args = [
            "--queue",
            self.queue,
            "--concurrency",
            str(self.concurrency),
            "--processes",
            str(self.processes),
            "--lease-ms",
            str(self.lease_ms),
            "--max-attempts",
            str(self.max_attempts),
            "--drain-timeout-s",
            str(self.drain_timeout_s),
            "--connect-timeout-s",
            str(self.connect_timeout_s),
            "--backend",
            self.backend,
            "--log-level",
            self.log_level,
        ]
        for module in self.imports:
            args += ["--import", module]
        if self.health_port is not None:
            args += ["--health-port", str(self.health_port)]
        return args
