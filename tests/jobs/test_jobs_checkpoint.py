"""Checkpoints: atomic writes, and a clear CheckpointError for every way a checkpoint
can be missing, damaged or belong to another job (nothing is overwritten then)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncgraph.jobs import CheckpointError, run_job
from asyncgraph.jobs._checkpoint import atomic_write_json, load_checkpoint

from .jobs_helpers import LineFit, listing, read_json


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2, "text": "é"})
    assert read_json(path) == {"a": 2, "text": "é"}
    assert listing(path.parent) == ["state.json"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})  # not JSON: fails before any byte is written
    assert read_json(path) == {"a": 1}
    assert listing(tmp_path) == ["state.json"]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real checkpoint of the LineFit job after all its steps."""
    import anyio

    out = tmp_path_factory.mktemp("good")
    anyio.run(lambda: run_job(LineFit().job, out, progress=False))
    data: dict[str, Any] = read_json(out / "checkpoint.json")
    return data


def _write(path: Path, content: bytes | dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


def _edit(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(ckpt: dict[str, Any]) -> dict[str, Any]:
        edited = json.loads(json.dumps(ckpt))
        for key, value in changes.items():
            if value is _DROP:
                del edited[key]
            else:
                edited[key] = value
        return edited

    return apply


_DROP = object()

# (case id, what the file holds, words the error must contain)
DAMAGED: list[tuple[str, Callable[[dict[str, Any]], bytes | dict[str, Any]], list[str]]] = [
    ("garbage-bytes", lambda ck: b"\x00\xffPK\x03\x04 not json at all", ["is corrupt", "not valid JSON", "delete it"]),
    ("truncated-json", lambda ck: json.dumps(ck).encode()[: len(json.dumps(ck)) // 2], ["is corrupt", "not valid JSON"]),
    ("empty-file", lambda ck: b"", ["is corrupt", "not valid JSON"]),
    ("history-json", lambda ck: {"history": ck["history"]}, ["is not an asyncgraph checkpoint", "--out"]),
    ("json-list", lambda ck: [1, 2, 3], ["is not an asyncgraph checkpoint"]),  # type: ignore[list-item]
    ("future-version", _edit(version=99), ["has version 99", "reads version 1"]),
    ("missing-field", _edit(optimizer=_DROP), ["is corrupt", "field 'optimizer' is missing"]),
    ("job-not-a-map", _edit(job="line-fit"), ["is corrupt", "field 'job' is not a map"]),
]


@pytest.mark.parametrize(("content", "words"), [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED])
def test_a_damaged_checkpoint_raises_a_clear_error(
    tmp_path: Path,
    good_checkpoint: dict[str, Any],
    content: Callable[[dict[str, Any]], Any],
    words: list[str],
) -> None:
    path = tmp_path / "checkpoint.json"
    _write(path, content(good_checkpoint))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, LineFit().job.identity())
    message = str(info.value)
    assert repr(str(path)) in message
    for word in words:
        assert word in message


def test_a_missing_checkpoint_says_to_start_fresh(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at .* run without --resume"):
        load_checkpoint(tmp_path / "checkpoint.json", LineFit().job.identity())


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"batch_size": 3}, "batch_size is 4 there but 3 now"),
        ({"epochs": 2}, "epochs is 3 there but 2 now"),
        ({"seed": 9}, "seed is 3 there but 9 now"),
        ({"name": "other"}, "name is 'line-fit' there but 'other' now"),
        ({"train": [{"x": 1.0, "y": 2.0}] * 12}, "train_set is '"),
    ],
    ids=["batch_size", "epochs", "seed", "name", "train_set"],
)
def test_a_checkpoint_of_another_job_is_refused(
    tmp_path: Path, good_checkpoint: dict[str, Any], settings: dict[str, Any], words: str
) -> None:
    path = tmp_path / "checkpoint.json"
    _write(path, good_checkpoint)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, LineFit(**settings).job.identity())
    message = str(info.value)
    assert "belongs to a different job" in message and words in message
    assert "use another output directory" in message


# Checkpoints that parse and match the job but whose fields cannot be restored.
UNRESTORABLE: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str]] = [
    ("step-not-a-number", _edit(step="three"), "step is 'three'"),
    ("step-beyond-the-job", _edit(step=99), "step is 99, not a step number in 0..9"),
    ("history-too-short", lambda ck: {**ck, "history": ck["history"][:2]}, "one row per step"),
    ("no-parameters", _edit(parameters=[]), "'parameters' is not a list of 1"),
    ("optimizer-garbage", _edit(optimizer="sgd"), "optimizer state does not load"),
    ("optimizer-other-groups", _edit(optimizer={"state": {}, "param_groups": []}), "optimizer state does not load"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("edit", "words"), [c[1:] for c in UNRESTORABLE], ids=[c[0] for c in UNRESTORABLE])
async def test_resume_from_an_unrestorable_checkpoint_raises_checkpoint_error(
    tmp_path: Path,
    good_checkpoint: dict[str, Any],
    edit: Callable[[dict[str, Any]], dict[str, Any]],
    words: str,
) -> None:
    path = tmp_path / "checkpoint.json"
    _write(path, edit(good_checkpoint))
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        await run_job(LineFit().job, tmp_path, resume=True, progress=False)
    assert "is corrupt" in str(info.value) and words in str(info.value)
    assert path.read_bytes() == before  # a failed resume does not overwrite the checkpoint
    assert listing(tmp_path) == ["checkpoint.json"]


@pytest.mark.anyio
async def test_resume_from_a_corrupt_checkpoint_leaves_it_and_the_job_alone(
    tmp_path: Path, good_checkpoint: dict[str, Any]
) -> None:
    path = tmp_path / "checkpoint.json"
    text = json.dumps(good_checkpoint)
    _write(path, text[: len(text) - 10].encode())
    fit = LineFit()
    with pytest.raises(CheckpointError, match="is corrupt"):
        await run_job(fit.job, tmp_path, resume=True, progress=False)
    assert fit.w.data == 0.0
    assert path.read_bytes() == text[: len(text) - 10].encode()
