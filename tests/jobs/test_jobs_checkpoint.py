"""Checkpoints: atomic writes, and a clear CheckpointError for every way a checkpoint
can be missing, damaged or belong to another job (nothing is overwritten then)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph import Parameter, Variable
from asyncgraph.jobs import CheckpointError, Evaluation, Job, run_job
from asyncgraph.jobs._checkpoint import atomic_write_json, load_checkpoint
from asyncgraph.text import concat

from .jobs_helpers import LR, LineFit, listing, read_json


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


def _write(path: Path, content: Any) -> None:
    """``content`` as is (bytes) or as JSON (anything else)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


def _edit(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(ckpt: dict[str, Any]) -> dict[str, Any]:
        edited: dict[str, Any] = json.loads(json.dumps(ckpt))
        for key, value in changes.items():
            if value is _DROP:
                del edited[key]
            else:
                edited[key] = value
        return edited

    return apply


_DROP = object()

# (case id, what the file holds, words the error must contain)
DAMAGED: list[tuple[str, Callable[[dict[str, Any]], Any], list[str]]] = [
    (
        "garbage-bytes",
        lambda ck: b"\x00\xffPK\x03\x04 not json at all",
        ["is corrupt", "not valid JSON", "delete it"],
    ),
    (
        "truncated-json",
        lambda ck: json.dumps(ck).encode()[: len(json.dumps(ck)) // 2],
        ["is corrupt", "not valid JSON"],
    ),
    ("empty-file", lambda ck: b"", ["is corrupt", "not valid JSON"]),
    (
        "history-json",
        lambda ck: {"history": ck["history"]},
        ["is not an asyncgraph checkpoint", "--out"],
    ),
    ("json-list", lambda ck: [1, 2, 3], ["is not an asyncgraph checkpoint"]),
    ("future-version", _edit(version=99), ["has version 99", "reads version 1"]),
    ("missing-field", _edit(optimizer=_DROP), ["is corrupt", "field 'optimizer' is missing"]),
    ("job-not-a-map", _edit(job="line-fit"), ["is corrupt", "field 'job' is not a map"]),
    (
        "nested-beyond-the-parser",
        lambda ck: b"[" * 200_000 + b"]" * 200_000,
        ["is corrupt", "nested too deeply"],
    ),
    (
        "nested-in-a-field",
        lambda ck: (
            json.dumps({**ck, "history": "HERE"}).replace('"HERE"', "[" * 100_000 + "]" * 100_000)
        ).encode(),
        ["is corrupt", "nested too deeply"],
    ),
]


@pytest.mark.parametrize(
    ("content", "words"), [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED]
)
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
    (
        "optimizer-other-groups",
        _edit(optimizer={"state": {}, "param_groups": []}),
        "optimizer state does not load",
    ),
    (
        "optimizer-bad-option",
        lambda ck: _deep_set(ck, ["optimizer", "param_groups", 0, "lr"], "fast"),
        "optimizer state does not load into this job's SGD (TypeError: SGD: lr must be a number",
    ),
    # Parses (under json's nesting limit) but too deep for load_state_dict's deepcopy.
    (
        "optimizer-nested-deep",
        lambda ck: _deep_set(ck, ["optimizer", "param_groups", 0, "extra"], _nested(800)),
        "(RecursionError: ",
    ),
    (
        "history-row-missing-field",
        lambda ck: _deep_del(ck, ["history", 2, "tokens"]),
        "history row 2 has no field 'tokens'",
    ),
    (
        "history-row-wrong-type",
        lambda ck: _deep_set(ck, ["history", 1, "train_score"], "0.5"),
        "history row 1 field 'train_score' is '0.5', not a number",
    ),
    (
        "history-val-score-text",
        lambda ck: _deep_set(ck, ["history", 1, "val_score"], "good"),
        "history row 1 field 'val_score' is 'good', not a number or null",
    ),
    (
        "history-tokens-negative",
        lambda ck: _deep_set(ck, ["history", 0, "tokens"], -3),
        "history row 0 field 'tokens' is -3, not a token count",
    ),
    (
        "history-row-not-a-map",
        lambda ck: _deep_set(ck, ["history", 4], [1, 2]),
        "history row 4 is [1, 2], not a map",
    ),
    (
        "history-rows-out-of-order",
        lambda ck: _deep_set(ck, ["history", 0, "step"], 2),
        "history row 0 is for step 2 of epoch 0, expected step 1 of epoch 0",
    ),
    ("epoch-position-mismatch", _edit(position=3), "position 3 do not match step 9"),
    ("initial-val-score-text", _edit(initial_val_score="0"), "initial_val_score is '0'"),
    (
        "parameter-text-for-a-number",
        lambda ck: _deep_set(ck, ["parameters", 0, "data"], "2.5"),
        "the value of parameter 0 ('slope') is a str, but the parameter holds a number",
    ),
    (
        "parameter-other-role",
        lambda ck: _deep_set(ck, ["parameters", 0, "role"], "bias"),
        "parameter 0 has role 'bias', not 'slope'",
    ),
    # The best validation so far (best.json's record, keep_best, patience): these used to
    # escape as ValueError / KeyError / TypeError, or ("no") stop the job as if true.
    ("best-not-a-map", _edit(best=[1]), "'best' is [1], not null or a map"),
    (
        "best-without-its-score",
        lambda ck: _deep_del(ck, ["best", "val_score"]),
        "not null or a map of a step up to 9, a val_score and parameters",
    ),
    (
        "best-after-the-last-step",
        lambda ck: _deep_set(ck, ["best", "step"], 10),
        "not null or a map of a step up to 9",
    ),
    (
        "best-parameter-text-for-a-number",
        lambda ck: _deep_set(ck, ["best", "parameters", 0, "data"], "2.5"),
        "the parameters of 'best': the value of parameter 0 ('slope') is a str",
    ),
    ("since-best-text", _edit(since_best="x"), "since_best is 'x', not a count of validations"),
    ("since-best-negative", _edit(since_best=-1), "since_best is -1, not a count"),
    ("stopped-early-text", _edit(stopped_early="no"), "stopped_early is 'no', not true or false"),
    ("spent-not-a-map", _edit(spent=[1]), "spent is [1], not a map of"),
    (
        "spent-negative-cost",
        _edit(spent={"tokens": 1, "cost_usd": -1.0, "unpriced_calls": 0}),
        "spent is {'tokens': 1, 'cost_usd': -1.0",
    ),
    ("initial-usage-text", _edit(initial_usage="free"), "initial_usage is 'free', not a map"),
]


def _nested(depth: int) -> Any:
    value: Any = 0.0
    for _ in range(depth):
        value = [value]
    return value


def _deep_set(ckpt: dict[str, Any], where: list[Any], value: Any) -> dict[str, Any]:
    edited: dict[str, Any] = json.loads(json.dumps(ckpt))
    target = edited
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    return edited


def _deep_del(ckpt: dict[str, Any], where: list[Any]) -> dict[str, Any]:
    edited: dict[str, Any] = json.loads(json.dumps(ckpt))
    target = edited
    for key in where[:-1]:
        target = target[key]
    del target[where[-1]]
    return edited


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("edit", "words"), [c[1:] for c in UNRESTORABLE], ids=[c[0] for c in UNRESTORABLE]
)
async def test_resume_from_an_unrestorable_checkpoint_raises_checkpoint_error(
    tmp_path: Path,
    good_checkpoint: dict[str, Any],
    edit: Callable[[dict[str, Any]], dict[str, Any]],
    words: str,
) -> None:
    path = tmp_path / "checkpoint.json"
    _write(path, edit(good_checkpoint))
    before = path.read_bytes()
    fit = LineFit()
    with pytest.raises(CheckpointError) as info:
        await run_job(fit.job, tmp_path, resume=True, progress=False)
    assert "is corrupt" in str(info.value) and words in str(info.value)
    assert path.read_bytes() == before  # a failed resume does not overwrite the checkpoint
    assert listing(tmp_path) == ["checkpoint.json"]
    # Nothing of the checkpoint went into the job.
    assert fit.w.data == 0.0 and fit.optimizer.state == {}
    assert fit.optimizer.param_groups[0]["lr"] == LR


@pytest.mark.anyio
@pytest.mark.parametrize("absent", [_DROP, None], ids=["missing", "null"])
async def test_a_checkpoint_without_the_best_fields_still_resumes(
    tmp_path: Path, good_checkpoint: dict[str, Any], absent: Any
) -> None:
    # As written before best.json existed: no best record, no count, not stopped.
    fields = ("best", "since_best", "stopped_early")
    _write(tmp_path / "checkpoint.json", _edit(**dict.fromkeys(fields, absent))(good_checkpoint))
    fit = LineFit()
    result = await run_job(fit.job, tmp_path, resume=True, progress=False)
    assert result.already_finished and not result.stopped_early
    assert result.best_val_score is None and result.best_parameters is None
    assert fit.w.data == good_checkpoint["parameters"][0]["data"]


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


class Holder:
    """An optimizer over one text parameter; its state is whatever it was given."""

    def __init__(self, prompt: Parameter, *, fail_load: bool = False) -> None:
        self.prompt = prompt
        self.state: dict[str, Any] = {"steps": 0}
        self.fail_load = fail_load

    def zero_grad(self) -> None:
        self.prompt.grad = None

    async def step(self) -> None:
        self.state["steps"] += 1
        self.prompt.data = f"{self.prompt.data}!"

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)
        if self.fail_load:
            raise RuntimeError("this optimizer's state format changed")


def _text_job(fail_load: bool = False) -> tuple[Job, Parameter, Holder]:
    prompt = Parameter("Be brief.", role="system prompt")
    optimizer = Holder(prompt, fail_load=fail_load)

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        return Evaluation(loss=concat(prompt, Variable(f" q{example['q']}")), score=0.0)

    job = Job(
        name="text",
        parameters=[prompt],
        optimizer=optimizer,
        forward=forward,
        train_set=[{"q": i} for i in range(4)],
        batch_size=2,
    )
    return job, prompt, optimizer


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("value", "words"),
    [
        (42, "is a number, but the parameter holds a str"),
        (["Be brief."], "is a list, but the parameter holds a str"),
        (None, "is a null, but the parameter holds a str"),
    ],
    ids=["number", "list", "null"],
)
async def test_a_text_parameter_resumed_from_a_non_text_value_raises(
    tmp_path: Path, value: Any, words: str
) -> None:
    job, _, _ = _text_job()
    await run_job(job, tmp_path, progress=False)
    ckpt = read_json(tmp_path / "checkpoint.json")
    ckpt["parameters"][0]["data"] = value
    _write(tmp_path / "checkpoint.json", ckpt)
    fresh, prompt, _ = _text_job()
    with pytest.raises(CheckpointError, match=words):
        await run_job(fresh, tmp_path, resume=True, progress=False)
    assert prompt.data == "Be brief."


@pytest.mark.anyio
async def test_an_optimizer_state_that_fails_to_load_is_a_checkpoint_error(tmp_path: Path) -> None:
    job, _, _ = _text_job()
    await run_job(job, tmp_path, progress=False)
    fresh, prompt, optimizer = _text_job(fail_load=True)
    with pytest.raises(CheckpointError) as info:
        await run_job(fresh, tmp_path, resume=True, progress=False)
    assert "optimizer state does not load into this job's Holder" in str(info.value)
    assert "RuntimeError: this optimizer's state format changed" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert prompt.data == "Be brief." and optimizer.state == {"steps": 0}  # put back


@pytest.mark.anyio
async def test_an_output_directory_that_cannot_be_written_is_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(
        CheckpointError, match=r"cannot write the checkpoint .*a-file/out/checkpoint"
    ):
        await run_job(LineFit().job, tmp_path / "a-file" / "out", progress=False)
    assert listing(tmp_path) == ["a-file"]


@pytest.mark.anyio
async def test_a_numpy_parameter_is_checkpointed_as_a_list_and_resumed_as_an_array(
    tmp_path: Path,
) -> None:
    numpy = pytest.importorskip("numpy")
    from asyncgraph import Function
    from asyncgraph.optim import SGD

    class SumError(Function):
        """``(sum(w) * x - y) ** 2``: a number, with an array gradient for ``w``."""

        @staticmethod
        def forward(ctx: Any, w: Variable, x: float, y: float) -> Variable:
            ctx.residual, ctx.x, ctx.shape = float(w.data.sum()) * x - y, x, w.data.shape
            return Variable(ctx.residual**2)

        @staticmethod
        def backward(ctx: Any, g: Variable) -> tuple[Any, None, None]:
            return numpy.full(ctx.shape, 2 * ctx.residual * ctx.x * g.data), None, None

    def make() -> tuple[Job, Parameter]:
        w = Parameter(numpy.zeros(2), role="weights")

        async def forward(example: Mapping[str, Any]) -> Evaluation:
            return Evaluation(loss=SumError.apply(w, example["x"], example["y"]), score=0.0)

        job = Job(
            name="array",
            parameters=[w],
            optimizer=SGD([w], lr=0.01, momentum=0.5),
            forward=forward,
            train_set=[{"x": 1.0, "y": 2.0}] * 4,
            batch_size=2,
        )
        return job, w

    job, w = make()
    await run_job(job, tmp_path, progress=False)
    ckpt = read_json(tmp_path / "checkpoint.json")
    assert ckpt["parameters"][0]["data"] == w.data.tolist()

    fresh, w2 = make()
    await run_job(fresh, tmp_path, resume=True, progress=False)
    assert isinstance(w2.data, numpy.ndarray) and w2.data.tolist() == w.data.tolist()

    ckpt["parameters"][0]["data"] = [1.0, 2.0, 3.0]
    _write(tmp_path / "checkpoint.json", ckpt)
    other, w3 = make()
    with pytest.raises(CheckpointError, match=r"is an array of shape \(3,\), not \(2,\)"):
        await run_job(other, tmp_path, resume=True, progress=False)
    assert w3.data.tolist() == [0.0, 0.0]
