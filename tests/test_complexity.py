"""The engine's heart stays readable (#36): no function or method in the core, the task
channel, the fleet's status reading or the structured-output validator is of radon's rank
D or worse (cyclomatic complexity above 20). A function that grows past it is split into
steps with names, as ``Function._record`` and ``TaskChannel._flush`` were."""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_rank, cc_visit
from radon.visitors import Function

ROOT = Path(__file__).resolve().parent.parent
CHECKED = [
    "asyncgraph/_core",
    "asyncgraph/distributed/_channel.py",
    "asyncgraph/distributed/_status.py",
    "asyncgraph/text/_structured.py",
]
WORST_RANK = "C"  # 11-20; D is 21-30


def _sources() -> list[Path]:
    files: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _too_complex() -> list[str]:
    """``file:line name - rank (complexity)`` for each function above ``WORST_RANK``."""
    found = []
    for path in _sources():
        for block in cc_visit(path.read_text(encoding="utf-8")):
            rank = cc_rank(block.complexity)
            if isinstance(block, Function) and rank > WORST_RANK:
                where = f"{path.relative_to(ROOT)}:{block.lineno}"
                found.append(f"{where} {block.fullname} - {rank} ({block.complexity})")
    return found


def test_every_checked_path_is_there() -> None:
    # A path renamed away would make the check below pass on nothing.
    assert all((ROOT / name).exists() for name in CHECKED), CHECKED
    assert len(_sources()) > len(CHECKED)


def test_no_function_of_the_heart_is_of_rank_d_or_worse() -> None:
    too_complex = _too_complex()
    assert not too_complex, (
        "cyclomatic complexity above 20 (radon rank D or worse); split each into steps "
        "with names (`python -m radon cc -s -n D "
        + " ".join(CHECKED)
        + "`):\n  "
        + "\n  ".join(too_complex)
    )
