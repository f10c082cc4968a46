"""One worker configuration, from flags or the environment, checked once.

Every setting has a field, a flag and an environment variable, listed once in
``SETTINGS``: ``asyncgraph worker`` builds its flags from that table, the service in
``workers/`` reads the environment through it, and the supervisor and the local
fleet hand a configuration to child processes with ``to_args`` + ``to_env``. A
flag wins over its variable.

The Redis URL (it may hold a password), the shared secret and the allowed base URLs
never go on a command line (``ps`` shows argv to every user of the machine): only
``to_env`` carries them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from asyncgraph._exceptions import ConfigError
from asyncgraph._redact import redact_url
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS, Limits

__all__ = ["SETTINGS", "ConfigError", "Setting", "WorkerConfig", "log_level"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def log_level(text: str) -> str:
    """argparse type: a logging level name, any case (argparse applies it to the
    environment default too, so a bad ASYNCGRAPH_LOG_LEVEL is a usage error as well)."""
    level = str(text).strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


@dataclass(frozen=True)
class Setting:
    """One setting: its ``WorkerConfig`` field, flag, variable, how text becomes a value."""

    field: str
    flag: str
    help: str
    parse: Callable[[str], Any] = str
    env: str | None = None  # default: ASYNCGRAPH_<FIELD>
    secret: bool = False  # travels in the environment only (to_env), never in argv
    many: bool = False  # repeatable flag; comma-separated in the environment
    hidden: bool = False  # set by the supervisor for its children

    @property
    def variable(self) -> str:
        return self.env or f"ASYNCGRAPH_{self.field.upper()}"


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {text!r}") from None


def _optional_port(text: str) -> int | None:
    return None if not text.strip() else _integer(text)


def _level(text: str) -> str:
    try:
        return log_level(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "redis_url",
        "--redis",
        "Redis URL: redis://, rediss:// (TLS), redis+sentinel://, redis+cluster://, "
        f"user:password@ for ACLs; default {DEFAULT_REDIS_URL}",
        secret=True,
    ),
    Setting("queue", "--queue", "queue name"),
    Setting(
        "imports",
        "--import",
        "module whose Functions with dispatch='remote' this worker serves (repeatable; "
        "at least one)",
        many=True,
    ),
    Setting("concurrency", "--concurrency", "tasks one process runs at once", _integer),
    Setting("processes", "--processes", "worker processes to run and supervise", _integer),
    Setting(
        "secret",
        "--secret",
        "shared HMAC secret (prefer the variable: argv is visible to other users)",
        secret=True,
    ),
    Setting(
        "lease_ms",
        "--lease-ms",
        "a task held this long without renewal is reclaimed by another worker",
        _integer,
    ),
    Setting(
        "max_attempts",
        "--max-attempts",
        "deliveries before a task that never completes is dead-lettered",
        _integer,
    ),
    Setting("batch_size", "--batch-size", "tasks read per XREADGROUP at most", _integer),
    Setting(
        "drain_timeout_s",
        "--drain-timeout-s",
        "on SIGTERM, how long held tasks may finish",
        _seconds,
    ),
    Setting("redis_timeout_s", "--redis-timeout-s", "deadline of each Redis call", _seconds),
    Setting(
        "health_port",
        "--health-port",
        "serve /livez, /readyz and /metrics on this port (0: any free port; empty: off)",
        _optional_port,
    ),
    Setting(
        "health_host",
        "--health-host",
        "address the health endpoint binds: 127.0.0.1 answers this machine only; 0.0.0.0 "
        "every interface (a container whose probes and scrapers reach the pod's address)",
    ),
    Setting(
        "allowed_base_urls",
        "--allow-base-url",
        "a model base URL tasks may name, as a spec's base_url or a call's api_base / "
        "base_url param (repeatable; comma-separated in the variable): the worker sends its "
        "own API key there. The providers' default URLs (and $OPENAI_BASE_URL, "
        "$ANTHROPIC_BASE_URL, $AZURE_OPENAI_ENDPOINT) are always allowed; any other URL in a "
        "task, or a credential or header in its params, fails that task",
        secret=True,
        many=True,
    ),
    Setting(
        "connect_timeout_s",
        "--connect-timeout-s",
        "at start, how long to retry connecting to Redis (0: forever; health answers 503 "
        "meanwhile)",
        _seconds,
    ),
    Setting(
        "max_abandoned",
        "--max-abandoned",
        "synchronous calls that may run on in their threads after their task was cancelled "
        "(they take no slot); one more and the worker drains and exits with code 75, to be "
        "replaced by its supervisor or orchestrator (0: as many as --concurrency)",
        _integer,
    ),
    Setting("max_message_bytes", "--max-message-bytes", "largest message accepted", _integer),
    Setting("backend", "--backend", "event loop that runs async backwards: asyncio or trio"),
    Setting(
        "log_level",
        "--log-level",
        "DEBUG, INFO, WARNING, ERROR or CRITICAL; INFO shows reclaims and dead letters, DEBUG "
        "every task",
        _level,
    ),
    Setting("consumer", "--consumer", "consumer name in the group (default: host-pid-random)"),
    Setting("metrics_dir", "--metrics-dir", "", hidden=True),
    Setting("supervisor_pid", "--supervisor-pid", "", _integer, hidden=True),
)
_BY_FIELD = {s.field: s for s in SETTINGS}


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker service (the ``asyncgraph worker`` flags), checked at creation.

    ``imports``, ``processes``, ``backend`` and ``log_level`` concern the command (which
    modules, how many processes, which event loop, how loud); a ``Worker`` object uses
    the rest. A wrong value raises ``ConfigError`` (a ``ValueError``) naming the setting.

    Example::

        config = WorkerConfig(redis_url="redis://127.0.0.1:6379/0", imports=("myfunctions",))
        print(config.to_args())               # ['--import', 'myfunctions']
        config = WorkerConfig.from_env()      # ASYNCGRAPH_REDIS_URL, ASYNCGRAPH_CONCURRENCY, ...
    """

    redis_url: str
    queue: str = "grads"
    imports: tuple[str, ...] = ()
    concurrency: int = 64
    processes: int = 1
    secret: str | None = None
    lease_ms: int = 10_000
    max_attempts: int = 3
    batch_size: int = 256
    redis_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    health_host: str = "127.0.0.1"
    health_port: int | None = None
    consumer: str | None = None
    metrics_dir: str | None = None
    supervisor_pid: int | None = None
    limits: Limits = DEFAULT_LIMITS
    allowed_base_urls: tuple[str, ...] = ()
    connect_timeout_s: float = 0.0
    max_abandoned: int = 0
    backend: str = "asyncio"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_texts()

    def __repr__(self) -> str:
        # A config is logged and shown in errors: its URLs redacted, its secret masked.
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr} | {
            "redis_url": redact_url(self.redis_url),
            "secret": None if self.secret is None else "***",
            "allowed_base_urls": tuple(redact_url(url) for url in self.allowed_base_urls),
        }
        return f"WorkerConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def _check_numbers(self) -> None:
        for name in ("concurrency", "processes", "lease_ms", "max_attempts", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be >= 1, got {value!r}")
        if self.lease_ms < 200:
            raise ConfigError("lease_ms", f"must be >= 200, got {self.lease_ms}")
        for name in ("redis_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ConfigError(name, f"must be > 0 and finite, got {value!r}")
        if not 0 <= self.connect_timeout_s < float("inf"):
            raise ConfigError(
                "connect_timeout_s",
                f"must be >= 0 and finite (0: retry forever), got {self.connect_timeout_s!r}",
            )
        if (
            not isinstance(self.max_abandoned, int)
            or isinstance(self.max_abandoned, bool)
            or self.max_abandoned < 0
        ):
            raise ConfigError(
                "max_abandoned", f"must be >= 0 (0: the concurrency), got {self.max_abandoned!r}"
            )
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ConfigError("health_port", f"must be 0 to 65535, got {self.health_port!r}")

    def _check_texts(self) -> None:
        if self.redis_url != DEFAULT_REDIS_URL:  # the default is valid: --help needs no client
            from asyncgraph.resp import parse_redis_url

            _check("redis_url", parse_redis_url, self.redis_url)
        _check("queue", keys.check_queue_name, self.queue)
        if self.secret is not None and len(self.secret.encode()) < 16:
            raise ConfigError(
                "secret",
                "must be at least 16 bytes long; generate one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`",
            )
        for url in self.allowed_base_urls:
            _check("allowed_base_urls", _check_base_url, url)
        if self.backend not in ("asyncio", "trio"):
            raise ConfigError("backend", f"must be asyncio or trio, got {self.backend!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )

    # -- from text -----------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **defaults: Any) -> WorkerConfig:
        """The configuration in ``ASYNCGRAPH_*`` variables (``os.environ`` by default).

        ``defaults`` apply to the settings whose variable is unset (or empty); a wrong
        value raises ``ConfigError`` naming the variable.
        """
        env = os.environ if env is None else env
        values = dict(defaults)
        for setting in SETTINGS:
            raw = env.get(setting.variable)
            if raw is None or (not raw.strip() and setting.field != "health_port"):
                continue
            values[setting.field] = _parsed(setting, raw, setting.variable)
        return _build(values, lambda s: s.variable)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, env: Mapping[str, str] | None = None
    ) -> WorkerConfig:
        """The configuration of ``asyncgraph worker``'s flags (``add_arguments``).

        A flag left out falls back to its variable in ``env`` (``os.environ`` by
        default), then to the default; ``--allow-base-url`` adds to its variable.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            given = getattr(args, setting.field, None)
            raw = env.get(setting.variable)
            if setting.many:
                listed = list(given or [])
                if raw and (setting.field == "allowed_base_urls" or not listed):
                    listed = _split(raw) + listed
                if listed:
                    values[setting.field] = tuple(dict.fromkeys(listed))
            elif given is not None:
                values[setting.field] = given
            elif raw is not None and (raw.strip() or setting.field == "health_port"):
                values[setting.field] = _parsed(setting, raw, setting.variable)
        return _build(values, lambda s: s.flag)

    # -- to text -------------------------------------------------------------------------
    def to_args(self) -> list[str]:
        """Flags for ``asyncgraph worker`` giving this configuration, secrets left out.

        Pair with ``to_env()``: the Redis URL, the secret and the allowed base URLs go
        through the environment. Settings left at their default are not written.
        """
        argv: list[str] = []
        default = _defaults()
        for setting in SETTINGS:
            if setting.secret:
                continue
            value = _value(self, setting.field)
            if value == _value(default, setting.field):
                continue
            if setting.many:
                for item in value:
                    argv += [setting.flag, str(item)]
            elif value is not None:
                argv += [setting.flag, str(value)]
        return argv

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (``os.environ``) without any setting's variable, plus ``to_env()``.

        What a child process started with ``to_args()`` gets: a variable of the parent
        (``ASYNCGRAPH_PROCESSES=4``, ``ASYNCGRAPH_HEALTH_PORT``) must not reach it, where
        ``to_args()`` left the setting out because it is at its default.
        """
        base = os.environ if base is None else base
        own = {setting.variable for setting in SETTINGS}
        return {k: v for k, v in base.items() if k not in own} | self.to_env()

    def to_env(self) -> dict[str, str]:
        """The variables that carry what ``to_args`` leaves out (URL, secret, base URLs)."""
        env = {"ASYNCGRAPH_REDIS_URL": self.redis_url}
        env["ASYNCGRAPH_ALLOWED_BASE_URLS"] = ",".join(self.allowed_base_urls)
        if self.secret is not None:
            env["ASYNCGRAPH_SECRET"] = self.secret
        return env


def _check_base_url(url: str) -> None:
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base URL {redact_url(url)!r} is not an http:// or https:// URL")


def _check(field: str, check: Callable[[str], object], value: str) -> None:
    try:
        check(value)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from None


def _value(config: WorkerConfig, field: str) -> Any:
    if field == "max_message_bytes":
        return config.limits.max_message_bytes
    return getattr(config, field)


def _split(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _parsed(setting: Setting, raw: str, name: str) -> Any:
    if setting.many:
        return tuple(_split(raw))
    try:
        return setting.parse(raw.strip())
    except ValueError as exc:
        raise ConfigError(setting.field, str(exc)).with_name(name) from None


def _build(values: dict[str, Any], name_of: Callable[[Setting], str]) -> WorkerConfig:
    values.setdefault("redis_url", _defaults().redis_url)
    try:
        if "max_message_bytes" in values:
            size = values.pop("max_message_bytes")
            if not isinstance(size, int) or size < 1:
                raise ConfigError("max_message_bytes", f"must be >= 1, got {size!r}")
            values["limits"] = Limits(max_message_bytes=size)
        return WorkerConfig(**values)
    except ConfigError as exc:
        raise exc.with_name(name_of(_BY_FIELD[exc.field])) from None


@functools.cache
def _defaults() -> WorkerConfig:
    """The defaults ``--help`` shows and the flags fall back on (made when first asked)."""
    return WorkerConfig(redis_url=DEFAULT_REDIS_URL)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``asyncgraph worker``'s flags, one per setting (defaults shown from ``WorkerConfig``)."""
    for setting in SETTINGS:
        if setting.hidden:
            parser.add_argument(
                setting.flag, dest=setting.field, type=setting.parse, help=argparse.SUPPRESS
            )
            continue
        default = _value(_defaults(), setting.field)
        shown = "" if setting.secret or default in (None, ()) else f"; default: {default}"
        kwargs: dict[str, Any] = {
            "dest": setting.field,
            "default": None,
            "help": f"{setting.help} (${setting.variable}{shown})",
        }
        if setting.many:
            kwargs.update(
                action="append", metavar="MODULE" if setting.field == "imports" else "URL"
            )
        else:
            kwargs["type"] = _argparse_type(setting)
        if setting.field == "backend":
            kwargs["choices"] = ("asyncio", "trio")
        if setting.field == "log_level":
            kwargs["metavar"] = "LEVEL"
        if setting.field == "redis_url":
            kwargs["metavar"] = "URL"
        parser.add_argument(setting.flag, **kwargs)


def _argparse_type(setting: Setting) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = setting.field
    return convert
