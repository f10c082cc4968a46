"""One worker configuration path: WorkerConfig from flags or variables, and back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asyncgraph.distributed import ConfigError, WorkerConfig
from asyncgraph.distributed.worker._config import SETTINGS, add_arguments


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


FULL = WorkerConfig(
    redis_url="rediss://user:pw@redis:6380/2",
    queue="q.1",
    imports=("a.b", "c"),
    concurrency=7,
    processes=3,
    secret="s" * 20,
    lease_ms=1234,
    max_attempts=5,
    batch_size=9,
    redis_timeout_s=2.5,
    drain_timeout_s=4.0,
    health_host="0.0.0.0",
    health_port=9200,
    consumer="me",
    allowed_base_urls=("http://vllm:8000/v1",),
    connect_timeout_s=1.5,
    max_abandoned=5,
    backend="trio",
    log_level="DEBUG",
)


def test_every_setting_has_a_field_and_every_field_a_setting() -> None:
    fields = {f.name for f in dataclasses.fields(WorkerConfig)} - {"limits"}
    assert {s.field for s in SETTINGS} == fields | {"max_message_bytes"}


def test_to_args_and_to_env_give_back_the_same_configuration() -> None:
    config = dataclasses.replace(
        FULL, limits=dataclasses.replace(FULL.limits, max_message_bytes=4096)
    )
    argv = config.to_args()
    env = config.to_env()
    # Secrets never reach argv (other users can read it).
    assert "s" * 20 not in argv and not any("pw@" in a for a in argv)
    assert not any("vllm" in a for a in argv)
    assert WorkerConfig.from_args(parse(argv), env) == config
    assert WorkerConfig.from_env({**env, **_as_env(config)}) == config


def _as_env(config: WorkerConfig) -> dict[str, str]:
    """The configuration written as ASYNCGRAPH_* variables (what a deployment sets)."""
    env = {}
    for setting in SETTINGS:
        value = (
            config.limits.max_message_bytes
            if setting.field == "max_message_bytes"
            else getattr(config, setting.field)
        )
        if value is None:
            continue
        env[setting.variable] = ",".join(value) if setting.many else str(value)
    return env


def test_a_flag_wins_over_its_variable_and_base_urls_add_up() -> None:
    env = {
        "ASYNCGRAPH_REDIS_URL": "redis://from-env:6379/0",
        "ASYNCGRAPH_LEASE_MS": "5000",
        "ASYNCGRAPH_CONCURRENCY": "8",
        "ASYNCGRAPH_IMPORTS": "env.mod",
        "ASYNCGRAPH_ALLOWED_BASE_URLS": "http://a:1/v1",
    }
    args = parse(["--lease-ms", "700", "--import", "flag.mod", "--allow-base-url", "http://b:2/v1"])
    config = WorkerConfig.from_args(args, env)
    assert config.redis_url == "redis://from-env:6379/0"
    assert (config.lease_ms, config.concurrency) == (700, 8)
    assert config.imports == ("flag.mod",)
    assert config.allowed_base_urls == ("http://a:1/v1", "http://b:2/v1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lease-ms", "100"], "--lease-ms must be >= 200, got 100"),
        (["--processes", "0"], "--processes must be >= 1, got 0"),
        (["--queue", "a b"], "--queue: queue name"),
        (["--redis", "http://x"], "--redis: invalid Redis URL"),
        (["--secret", "short"], "--secret must be at least 16 bytes"),
        (["--drain-timeout-s", "0"], "--drain-timeout-s must be > 0"),
        (["--max-message-bytes", "0"], "--max-message-bytes must be >= 1"),
    ],
)
def test_a_wrong_flag_is_named_as_the_user_wrote_it(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig.from_args(parse(argv), {})


def test_a_wrong_variable_is_named_and_a_wrong_keyword_too() -> None:
    with pytest.raises(ValueError, match="ASYNCGRAPH_BATCH_SIZE must be an integer, got 'lots'"):
        WorkerConfig.from_env({"ASYNCGRAPH_BATCH_SIZE": "lots"})
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        WorkerConfig(redis_url="redis://r", batch_size=0)
    with pytest.raises(SystemExit):  # argparse: the flag's own usage error
        parse(["--backend", "curio"])


def test_a_child_gets_no_variable_of_its_parent_but_what_to_env_carries() -> None:
    parent = {
        "PATH": "/bin",
        "ASYNCGRAPH_PROCESSES": "4",  # would make every child a supervisor
        "ASYNCGRAPH_HEALTH_PORT": "9100",  # would make every child bind the same port
        "ASYNCGRAPH_SECRET": "old" * 8,
    }
    child = dataclasses.replace(FULL, processes=1, health_port=None)
    env = child.child_env(parent)
    assert env["PATH"] == "/bin"
    assert "ASYNCGRAPH_PROCESSES" not in env and "ASYNCGRAPH_HEALTH_PORT" not in env
    assert env["ASYNCGRAPH_SECRET"] == FULL.secret
    assert WorkerConfig.from_args(parse(child.to_args()), env) == child


def test_repr_and_errors_of_a_config_show_no_password_nor_secret() -> None:
    config = WorkerConfig(
        redis_url="redis://u:cfg-pass-1@h:6379/0?password=cfg-pass-2",
        secret="cfg-secret-0123456789",
        allowed_base_urls=("http://a:cfg-pass-3@h/v1?api-key=cfg-key-4",),
    )
    shown = repr(config)
    assert "redis_url='redis://u:***@h:6379/0?password=***'" in shown and "secret='***'" in shown
    with pytest.raises(ConfigError) as wrong:
        WorkerConfig(redis_url="redis://h/0", allowed_base_urls=("ftp://a:cfg-pass-3@h/",))
    for secret in ("cfg-pass-1", "cfg-pass-2", "cfg-pass-3", "cfg-key-4", "cfg-secret"):
        assert secret not in shown and secret not in str(wrong.value)


def test_the_health_endpoint_binds_loopback_unless_told_otherwise() -> None:
    assert WorkerConfig("redis://127.0.0.1:6379/0").health_host == "127.0.0.1"
    assert WorkerConfig.from_env({"ASYNCGRAPH_HEALTH_HOST": "0.0.0.0"}).health_host == "0.0.0.0"
    assert WorkerConfig.from_args(parse(["--health-host", "::"]), {}).health_host == "::"


def test_max_abandoned_is_checked() -> None:
    assert WorkerConfig("redis://127.0.0.1:6379/0").max_abandoned == 0  # as many as concurrency
    with pytest.raises(ConfigError, match="ASYNCGRAPH_MAX_ABANDONED"):
        WorkerConfig.from_env({"ASYNCGRAPH_MAX_ABANDONED": "-1"})


def test_the_default_redis_url_parses_and_is_what_help_shows() -> None:
    """The default URL is not parsed to be shown (--help loads no Redis client): it must
    parse when the worker runs, and the flags must fall back on it."""
    from asyncgraph.distributed.worker._config import DEFAULT_REDIS_URL
    from asyncgraph.resp import parse_redis_url

    address = parse_redis_url(DEFAULT_REDIS_URL)
    assert (address.host, address.port, address.db) == ("127.0.0.1", 6379, 0)
    assert WorkerConfig.from_args(parse([]), {}).redis_url == DEFAULT_REDIS_URL
    assert DEFAULT_REDIS_URL in next(s.help for s in SETTINGS if s.field == "redis_url")
