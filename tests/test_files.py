"""Every file asyncgraph writes goes through one door (asyncgraph/_files.py): redacted,
0600 files and 0700 directories; and no module of the package writes a file another way."""

from __future__ import annotations

import ast
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph._files import (
    PrivateLines,
    append_private_line,
    private_dir,
    private_umask,
    write_credentials,
    write_private,
    write_private_json,
)
from asyncgraph._redact import register_secret

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-proj-Zq81hKx0Pw5vLm3NcT7bYd2R"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The widest umask (0): files would be 0666 and directories 0777 without us."""
    before = os.umask(0)
    try:
        yield
    finally:
        os.umask(before)


def test_a_file_and_its_new_directories_are_private_whatever_the_umask(
    tmp_path: Path, open_umask: None
) -> None:
    target = tmp_path / "runs" / "x" / "notes.txt"
    write_private(target, "hello")
    assert target.read_text() == "hello"
    assert mode(target) == 0o600
    assert mode(tmp_path / "runs") == 0o700 and mode(tmp_path / "runs" / "x") == 0o700


def test_an_existing_file_written_again_is_narrowed_and_replaced_atomically(
    tmp_path: Path, open_umask: None
) -> None:
    target = tmp_path / "wide.json"
    target.write_text("old")
    target.chmod(0o644)
    write_private_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1} and mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["wide.json"]  # no temporary file left


def test_text_and_json_are_redacted_bytes_are_not(tmp_path: Path) -> None:
    register_secret(KEY)
    write_private(tmp_path / "a.txt", f"key {KEY.upper()} at http://u:pw@h/v1?api-key=K")
    assert (tmp_path / "a.txt").read_text() == "key [redacted] at http://u:***@h/v1?api-key=***"
    # JSON string by string: a mask never breaks an escape next to it.
    value = {"q": f'"{KEY}"\n\\', KEY: [f"x {KEY[8:]}", 1.5, None]}
    write_private_json(tmp_path / "b.json", value)
    assert json.loads((tmp_path / "b.json").read_text()) == {
        "q": '"[redacted]"\n\\',
        "[redacted]": ["x [redacted]", 1.5, None],
    }
    write_private(tmp_path / "c.bin", KEY.encode())  # a picture: redacted before drawing
    assert (tmp_path / "c.bin").read_bytes() == KEY.encode()


def test_json_refuses_what_it_is_told_to(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Out of range float"):
        write_private_json(tmp_path / "n.json", {"x": float("nan")}, allow_nan=False)
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_private_json(tmp_path / "o.json", {"x": object()}, repr_unknown=False)
    write_private_json(tmp_path / "r.json", {"x": Path(KEY)})  # a repr, redacted
    register_secret(KEY)
    write_private_json(tmp_path / "r.json", {"x": Path(KEY)})
    assert "[redacted]" in json.loads((tmp_path / "r.json").read_text())["x"]


def test_lines_are_redacted_one_by_one_and_an_existing_log_is_narrowed(
    tmp_path: Path, open_umask: None
) -> None:
    register_secret(KEY)
    log = tmp_path / "logs" / "calls.jsonl"
    log.parent.mkdir()
    log.write_text('{"old": 1}\n')
    log.chmod(0o644)
    with PrivateLines(log) as lines:
        lines.write_json({"reply": f"echo {KEY[8:].lower()}"})
        lines.write(f"plain {KEY}")
    append_private_line(log, {"step": 2})
    assert log.read_text().splitlines() == [
        '{"old": 1}',
        '{"reply": "echo [redacted]"}',
        "plain [redacted]",
        '{"step": 2}',
    ]
    assert mode(log) == 0o600
    with PrivateLines(log, append=False) as lines:
        lines.write("fresh")
    assert log.read_text() == "fresh\n"
    with pytest.raises(ValueError, match="is closed"):
        lines.write("late")


def test_a_credentials_file_keeps_its_secret_and_is_private(
    tmp_path: Path, open_umask: None
) -> None:
    register_secret(KEY)
    path = write_credentials(tmp_path / "auth.conf", f"requirepass {KEY}\n")
    assert path.read_text() == f"requirepass {KEY}\n" and mode(path) == 0o600


def test_private_dir_makes_each_missing_directory_private(tmp_path: Path, open_umask: None) -> None:
    private_dir(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    private_dir(tmp_path / "a" / "b")  # exists: nothing changes, no error
    (tmp_path / "mine").mkdir(mode=0o755)
    private_dir(tmp_path / "mine")
    assert mode(tmp_path / "mine") == 0o755  # the user's own directory keeps its mode


def test_private_umask_covers_what_another_library_writes_and_is_restored(
    tmp_path: Path, open_umask: None
) -> None:
    with private_umask():
        (tmp_path / "lib").mkdir()
        (tmp_path / "lib" / "param").write_text("0.02")
    assert mode(tmp_path / "lib") == 0o700 and mode(tmp_path / "lib" / "param") == 0o600
    assert os.umask(0) == 0  # restored (the fixture's 0)


# -- no other way to write a file ----------------------------------------------------------

# Calls that create or write a file or a directory. ``tempfile.TemporaryDirectory`` and
# ``mkdtemp`` are not here: they make a 0700 directory (whose files still come through
# _files). A module that must write some other way is named in ALLOWED, with why.
WRITING_CALLS = frozenset(
    {
        "write_text",
        "write_bytes",
        "mkdir",
        "makedirs",
        "touch",
        "savefig",
        "mkstemp",
        "NamedTemporaryFile",
        "SpooledTemporaryFile",
        "TemporaryFile",
        "log_text",
        "log_dict",
        "log_figure",
        "log_image",
        "log_table",
        "FileHandler",
        "RotatingFileHandler",
        "TimedRotatingFileHandler",
    }
)
OWNED_CALLS = {  # a call of these names only when made on these modules
    "dump": {"json", "pickle", "yaml", "marshal"},
    "copy": {"shutil"},
    "copy2": {"shutil"},
    "copyfile": {"shutil"},
    "copytree": {"shutil"},
    "move": {"shutil"},
}
DOOR = "asyncgraph/_files.py"
ALLOWED = {
    # The figure is drawn into memory (io.BytesIO), then written with write_private.
    ("asyncgraph/jobs/_report.py", "savefig"),
}


WRITING_FLAGS = frozenset({"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"})


def _writes_mode(call: ast.Call) -> bool:
    """An ``open`` / ``fdopen`` call whose mode writes (``"w"``, ``"ab"``, ``"r+"``...)."""
    candidates = [*call.args[:2], *(k.value for k in call.keywords if k.arg == "mode")]
    return any(
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and len(arg.value) <= 3
        and bool(set(arg.value) & set("wax+"))
        for arg in candidates
    )


def _writes_flags(call: ast.Call) -> bool:
    """An ``os.open`` call whose flags write or create (``O_WRONLY``, ``O_CREAT``...)."""
    flags = [*call.args[1:2], *(k.value for k in call.keywords if k.arg == "flags")]
    return any(
        getattr(node, "attr", getattr(node, "id", None)) in WRITING_FLAGS
        for flag in flags
        for node in ast.walk(flag)
    )


def file_writers(path: Path) -> list[tuple[int, str, str]]:
    """``(line, owner, call)`` for each call in ``path`` that writes a file or makes a
    directory (``owner``: the name the call is made on, or "")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        value = getattr(func, "value", None)
        owner = value.id if isinstance(value, ast.Name) else ""
        if (
            (name == "open" and (_writes_flags(node) if owner == "os" else _writes_mode(node)))
            or (name == "fdopen" and _writes_mode(node))
            or name in WRITING_CALLS
            or owner in OWNED_CALLS.get(name, ())
        ):
            found.append((node.lineno, owner, name))
    return sorted(found)


def unexpected_writers(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: call`` for each writing call outside the door and ALLOWED (each path
    named relative to ``root``, the checkout's root unless a test gives its own)."""
    return [
        f"{where}:{line}: {owner + '.' if owner else ''}{name}"
        for path in paths
        if (where := path.relative_to(root).as_posix()) != DOOR
        for line, owner, name in file_writers(path)
        if (where, name) not in ALLOWED
    ]


def test_no_module_writes_a_file_but_through_the_one_door() -> None:
    sources = sorted([*(ROOT / "asyncgraph").rglob("*.py"), *(ROOT / "workers").rglob("*.py")])
    assert unexpected_writers(sources) == []


def test_the_check_finds_each_way_of_writing_a_file(tmp_path: Path) -> None:
    # A module at the same place in a copy of the tree under tmp_path: never in the checkout.
    probe = tmp_path / "asyncgraph" / "jobs" / "_files_probe_tmp.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "import json, os, shutil, tempfile\n"
        "from pathlib import Path\n"
        "def f(p, fig, client, data):\n"
        "    open(p, 'w')\n"
        "    open(p, mode='ab')\n"
        "    Path(p).open('w')\n"
        "    Path(p).write_text('x')\n"
        "    Path(p).mkdir()\n"
        "    os.makedirs(p)\n"
        "    os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)\n"
        "    os.fdopen(3, 'w')\n"
        "    json.dump(data, p)\n"
        "    fig.savefig(p)\n"
        "    tempfile.mkstemp()\n"
        "    shutil.copy(p, p)\n"
        "    client.log_text('r', 'x', 'a.txt')\n"
        "    open(p)\n"  # reading: fine
        "    os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), 'rb')\n"
        "    json.dumps(data)\n"  # not a file
        "    tempfile.TemporaryDirectory()\n"  # 0700
    )
    assert [line.split(": ", 1)[1] for line in unexpected_writers([probe], tmp_path)] == [
        "open",
        "open",
        "open",
        "write_text",
        "mkdir",
        "os.makedirs",
        "os.open",
        "os.fdopen",
        "json.dump",
        "fig.savefig",
        "tempfile.mkstemp",
        "shutil.copy",
        "client.log_text",
    ]
