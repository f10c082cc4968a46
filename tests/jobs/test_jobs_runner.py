"""run_job on a tiny numeric job, on asyncio and trio: the loop, checkpoints, history,
the plot, resume after a crash and after Ctrl-C (SIGINT in the middle of a step)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph import BackwardError, Function, Parameter, Variable, is_grad_enabled
from asyncgraph.jobs import CheckpointError, Evaluation, Job, evaluate, run_job
from asyncgraph.jobs._runner import train_loss

from .jobs_helpers import (
    EPOCHS,
    LR,
    PNG_MAGIC,
    TIMING_FIELDS,
    TRAIN,
    LineFit,
    listing,
    read_json,
    reference_fit,
    run_events,
    without,
)

pytestmark = pytest.mark.anyio

STEPS = EPOCHS * 3


async def test_run_job_matches_the_hand_written_loop(tmp_path: Path) -> None:
    fit = LineFit()
    result = await run_job(fit.job, tmp_path, progress=False)

    want_w, want_buf = reference_fit(fit.job)
    assert result.parameters == [want_w]
    assert fit.w.data == want_w
    assert fit.optimizer.state[fit.w]["momentum_buffer"] == want_buf
    assert result.steps_done == STEPS and not result.interrupted
    assert result.out_dir == tmp_path

    history = result.history
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["epoch"] for h in history] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Validation every 2 steps and after the last one.
    assert [h["step"] for h in history if h["val_score"] is not None] == [2, 4, 6, 8, 9]
    for k, row in enumerate(history):
        assert 0.0 <= row["train_score"] <= 1.0
        # The losses are numbers (squared errors): train_loss is their mean over the batch.
        w_k, _ = reference_fit(fit.job, k)
        batch = fit.job.batch(k)
        want_loss = sum((w_k * ex["x"] - ex["y"]) ** 2 for ex in batch) / len(batch)
        assert row["train_loss"] == pytest.approx(want_loss, rel=1e-12)
        assert row["tokens"] == 0 and row["cost_usd"] == 0.0  # no models in this job
        assert row["step_s"] >= 0.0
    # The fit converges: the last validation sees every point within tolerance.
    assert result.final_val_score == 1.0
    assert result.initial_val_score == 0.0
    assert result.final_val_score == history[-1]["val_score"]


async def test_checkpoint_holds_parameters_optimizer_position_and_history(tmp_path: Path) -> None:
    fit = LineFit()
    result = await run_job(fit.job, tmp_path, progress=False)

    ckpt = read_json(tmp_path / "checkpoint.json")
    assert ckpt["format"] == "asyncgraph-checkpoint" and ckpt["version"] == 1
    assert ckpt["job"] == fit.job.identity()
    assert ckpt["job"]["batch_size"] == 4 and ckpt["job"]["seed"] == 3
    # After the last step: the data position is the start of the epoch after the last.
    assert (ckpt["step"], ckpt["epoch"], ckpt["position"]) == (STEPS, EPOCHS, 0)
    assert ckpt["parameters"] == [{"role": "slope", "data": result.parameters[0]}]
    _, want_buf = reference_fit(fit.job)
    assert ckpt["optimizer"]["state"] == {"0": {"momentum_buffer": want_buf}}
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == LR
    assert ckpt["history"] == result.history
    assert ckpt["initial_val_score"] == 0.0

    assert read_json(tmp_path / "history.json") == {"history": result.history}
    png = (tmp_path / "metrics.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    # Atomic writes leave no temporary files behind.
    assert listing(tmp_path) == [
        "best.json",
        "checkpoint.json",
        "history.json",
        "metrics.png",
        "steps.jsonl",
    ]


async def test_a_checkpoint_is_written_after_every_step(tmp_path: Path) -> None:
    seen: list[tuple[int, int, int, float]] = []

    async def look(step: int) -> None:
        # The first forward of step k sees the checkpoint of step k (k steps done).
        ckpt = read_json(tmp_path / "checkpoint.json")
        seen.append((ckpt["step"], ckpt["epoch"], ckpt["position"], ckpt["parameters"][0]["data"]))
        assert len(ckpt["history"]) == ckpt["step"]

    fit = LineFit(on_forward=look)
    await run_job(fit.job, tmp_path, progress=False)
    assert [s[:3] for s in seen] == [
        (0, 0, 0), (1, 0, 4), (2, 0, 8),
        (3, 1, 0), (4, 1, 4), (5, 1, 8),
        (6, 2, 0), (7, 2, 4), (8, 2, 8),
    ]  # fmt: skip
    assert [s[3] for s in seen] == [reference_fit(fit.job, k)[0] for k in range(STEPS)]


@pytest.mark.parametrize("handle_sigint", [False, True])
async def test_resume_after_a_crash_in_a_backward_ends_like_an_uninterrupted_run(
    tmp_path: Path, handle_sigint: bool
) -> None:
    full = LineFit()
    uninterrupted = await run_job(full.job, tmp_path / "full", progress=False)

    async def crash(step: int) -> None:
        if step == 4:
            raise RuntimeError("worker lost its network")

    crashed = LineFit(on_backward=crash)
    with pytest.raises(BackwardError) as info:  # the error itself, not an ExceptionGroup
        await run_job(crashed.job, tmp_path / "run", progress=False, handle_sigint=handle_sigint)
    assert "worker lost its network" in str(info.value.__cause__ or info.value)
    ckpt = read_json(tmp_path / "run" / "checkpoint.json")
    assert ckpt["step"] == 4 and len(ckpt["history"]) == 4
    # The failed job still wrote the history and the plot of its completed steps.
    assert read_json(tmp_path / "run" / "history.json") == {"history": ckpt["history"]}
    assert (tmp_path / "run" / "metrics.png").read_bytes().startswith(PNG_MAGIC)

    resumed_fit = LineFit()
    resumed = await run_job(resumed_fit.job, tmp_path / "run", resume=True, progress=False)
    assert resumed.parameters == uninterrupted.parameters
    assert resumed_fit.optimizer.state_dict() == full.optimizer.state_dict()
    assert without(resumed.history, TIMING_FIELDS) == without(uninterrupted.history, TIMING_FIELDS)
    assert resumed.initial_val_score == uninterrupted.initial_val_score
    final = read_json(tmp_path / "run" / "checkpoint.json")
    reference = read_json(tmp_path / "full" / "checkpoint.json")
    for key in ("step", "epoch", "position", "parameters", "optimizer", "job"):
        assert final[key] == reference[key], key


async def test_sigint_mid_step_stops_cleanly_and_resume_matches(tmp_path: Path) -> None:
    full = LineFit()
    uninterrupted = await run_job(full.job, tmp_path / "full", progress=False)
    stop_at = 5
    reached = anyio.Event()

    async def interrupt(step: int) -> None:
        if step == stop_at:
            reached.set()
            # Ctrl-C while this step's forward is still running; run_job must cancel it.
            os.kill(os.getpid(), signal.SIGINT)
            await anyio.sleep(30)
            pytest.fail("the SIGINT did not cancel the step")

    fit = LineFit(on_forward=interrupt)
    with anyio.fail_after(30):
        result = await run_job(fit.job, tmp_path / "run", progress=False, handle_sigint=True)
    assert reached.is_set()
    assert result.interrupted and result.steps_done == stop_at
    assert len(result.history) == stop_at
    assert run_events(tmp_path / "run") == [("stop", stop_at, "interrupted")]  # for the dashboard
    # The half-done step is rolled back: the job holds the checkpointed state.
    want_w, want_buf = reference_fit(fit.job, stop_at)
    assert fit.w.data == want_w and result.parameters == [want_w]
    assert fit.optimizer.state[fit.w]["momentum_buffer"] == want_buf
    ckpt = read_json(tmp_path / "run" / "checkpoint.json")
    assert (ckpt["step"], ckpt["epoch"], ckpt["position"]) == (stop_at, 1, 8)
    assert ckpt["parameters"][0]["data"] == want_w
    assert read_json(tmp_path / "run" / "history.json")["history"] == result.history
    assert (tmp_path / "run" / "metrics.png").read_bytes().startswith(PNG_MAGIC)

    resumed_fit = LineFit()
    resumed = await run_job(resumed_fit.job, tmp_path / "run", resume=True, progress=False)
    assert resumed.parameters == uninterrupted.parameters
    assert resumed_fit.optimizer.state_dict() == full.optimizer.state_dict()
    assert without(resumed.history, TIMING_FIELDS) == without(uninterrupted.history, TIMING_FIELDS)


async def test_resume_of_a_finished_job_changes_nothing(tmp_path: Path) -> None:
    first = await run_job(LineFit().job, tmp_path, progress=False)
    again_fit = LineFit()
    again = await run_job(again_fit.job, tmp_path, resume=True, progress=False)
    assert again.steps_done == STEPS and again.parameters == first.parameters
    assert again.history == first.history


async def test_the_forward_runs_concurrently_up_to_max_concurrency(tmp_path: Path) -> None:
    running = 0
    peak = 0

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.01)
        running -= 1
        return Evaluation(loss=Variable(0.0), score=1.0)

    job = Job(
        name="bounded", parameters=[], optimizer=LineFit().optimizer, forward=forward,
        train_set=TRAIN, batch_size=12, max_concurrency=5,
    )  # fmt: skip
    assert await evaluate(job, TRAIN) == 1.0
    assert peak == 5


async def test_a_forward_that_returns_no_evaluation_is_named(tmp_path: Path) -> None:
    async def forward(example: Mapping[str, Any]) -> Any:
        return 0.5

    job = Job(
        name="bad", parameters=[], optimizer=LineFit().optimizer, forward=forward, train_set=TRAIN
    )
    with pytest.raises((TypeError, ExceptionGroup)) as info:
        await run_job(job, tmp_path, progress=False)
    errors = [info.value]
    while isinstance(errors[-1], ExceptionGroup):
        errors.append(errors[-1].exceptions[0])
    assert isinstance(errors[-1], TypeError)
    assert "a job's forward must return asyncgraph.jobs.Evaluation, got 0.5" in str(errors[-1])


class Answer(Function):
    """A stand-in for an LLM call: its backward gives the prompt feedback naming the example."""

    @staticmethod
    def forward(ctx: Any, prompt: Variable, name: str) -> Variable:
        ctx.name = name
        return Variable(f"answer to {name}", role="answer")

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> tuple[Variable, None]:
        await anyio.sleep(0.001 * (ctx.name % 3))  # finish in a scrambled order
        return Variable([f"feedback from example {ctx.name}"], role="feedback"), None


class RecordingOptimizer:
    """Records the prompt's gradient at every step; its state is what it saw."""

    def __init__(self, prompt: Parameter) -> None:
        self.prompt = prompt
        self.seen: list[Any] = []

    def zero_grad(self) -> None:
        self.prompt.grad = None

    async def step(self) -> None:
        self.seen.append(self.prompt.grad.data if self.prompt.grad is not None else None)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seen = list(state["seen"])


async def test_a_batch_gradient_is_summed_in_batch_order_whatever_runs_first(
    tmp_path: Path,
) -> None:
    prompt = Parameter("Be helpful.", role="system prompt")
    optimizer = RecordingOptimizer(prompt)
    examples = [{"name": i} for i in range(12)]

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        # Later examples of a batch reach the prompt first: creation order is reversed.
        await anyio.sleep(0.002 * (12 - example["name"]))
        answer = Answer.apply(prompt, example["name"])
        return Evaluation(loss=answer, score=0.0)

    job = Job(
        name="order",
        parameters=[prompt],
        optimizer=optimizer,
        forward=forward,
        train_set=examples,
        batch_size=6,
        epochs=2,
        max_concurrency=4,
    )
    await run_job(job, tmp_path, progress=False)
    assert optimizer.seen == [
        [f"feedback from example {ex['name']}" for ex in job.batch(step)]
        for step in range(job.total_steps)
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_progress_prints_one_line_per_step_off_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await run_job(LineFit().job, tmp_path, progress=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("line-fit:")]
    assert len(lines) == STEPS
    assert lines[-1].startswith(f"line-fit: step {STEPS}/{STEPS}  loss ")
    for word in ("loss", "acc", "val", "tokens", "$"):
        assert word in lines[-1]


def test_job_settings_are_checked() -> None:
    fit = LineFit()
    with pytest.raises(ValueError, match="job 'empty' has an empty train_set"):
        Job(name="empty", parameters=[], optimizer=fit.optimizer, forward=fit.forward, train_set=[])
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        Job(
            name="j",
            parameters=[],
            optimizer=fit.optimizer,
            forward=fit.forward,
            train_set=TRAIN,
            batch_size=0,
        )


@pytest.mark.parametrize("name", ["batch_size", "epochs", "max_concurrency", "validate_every"])
def test_a_bool_is_not_a_positive_int_setting(name: str) -> None:
    # True used to pass as 1 (patience already refused it).
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got True"):
        dataclasses.replace(LineFit().job, **{name: True})


def test_batches_cover_every_example_once_per_epoch_in_a_seeded_order() -> None:
    fit = LineFit(batch_size=5, epochs=2)  # 12 examples: batches of 5, 5, 2
    job = fit.job
    assert job.steps_per_epoch == 3 and job.total_steps == 6
    epochs = [[job.batch(s) for s in range(e * 3, e * 3 + 3)] for e in range(2)]
    for batches in epochs:
        assert [len(b) for b in batches] == [5, 5, 2]
        xs = sorted(ex["x"] for b in batches for ex in b)
        assert xs == sorted(ex["x"] for ex in TRAIN)
    assert epochs[0] != epochs[1]  # a new permutation per epoch
    again = LineFit(batch_size=5, epochs=2).job
    assert [again.batch(s) for s in range(6)] == [job.batch(s) for s in range(6)]
    other_seed = LineFit(batch_size=5, epochs=2, seed=4).job
    assert [other_seed.batch(s) for s in range(6)] != [job.batch(s) for s in range(6)]


def test_identity_names_what_a_resume_must_match() -> None:
    identity = LineFit().job.identity()
    assert set(identity) == {
        "name", "parameters", "train_set", "val_set", "batch_size", "epochs", "seed",
        "optimizer", "config",
    }  # fmt: skip
    assert identity["parameters"] == ["slope"]
    assert identity["optimizer"] == "SGD" and identity["config"] == {}
    assert LineFit(train=TRAIN[:-1]).job.identity()["train_set"] != identity["train_set"]
    json.dumps(identity)  # JSON-ready


def test_config_is_part_of_the_identity_as_it_reads_back_from_json() -> None:
    fit = LineFit()
    fit.job.config = {"model": "m", "sizes": (1, 2), "nested": {"b": None}}
    identity = fit.job.identity()
    assert identity["config"] == {"model": "m", "sizes": [1, 2], "nested": {"b": None}}
    assert json.loads(json.dumps(identity)) == identity  # compares equal after a checkpoint
    bad_configs: list[Any] = [
        {"f": object()},
        {"x": float("nan")},
        {"x": [1, {2: 3}], 4: "mixed keys"},
    ]
    for bad in bad_configs:
        with pytest.raises(ValueError, match="config must be JSON"):
            Job(
                name="j",
                parameters=[],
                optimizer=fit.optimizer,
                forward=fit.forward,
                train_set=TRAIN,
                config=bad,
            )


async def test_resume_with_another_config_or_optimizer_is_refused(tmp_path: Path) -> None:
    first = LineFit()
    first.job.config = {"model": "a", "temperature": 0.0}
    await run_job(first.job, tmp_path, progress=False)
    other = LineFit()
    other.job.config = {"model": "b", "temperature": 0.0}
    with pytest.raises(CheckpointError, match=r"config\['model'\] is 'a' there but 'b' now"):
        await run_job(other.job, tmp_path, resume=True, progress=False)
    recording = LineFit()
    recording.job.config = first.job.config
    recording.job.optimizer = RecordingOptimizer(Parameter("x"))
    with pytest.raises(CheckpointError, match="optimizer is 'SGD' there but 'RecordingOptimizer'"):
        await run_job(recording.job, tmp_path, resume=True, progress=False)


def test_train_loss_is_the_mean_of_numeric_losses_else_one_minus_the_score() -> None:
    numbers = [Evaluation(loss=Variable(v), score=1.0) for v in (0.5, 1.5, 4)]
    assert train_loss(numbers, 1.0) == 2.0
    texts = [
        Evaluation(loss=Variable("wrong: say X"), score=0.0),
        Evaluation(loss=Variable(0.5), score=1.0),
    ]
    assert train_loss(texts, 0.5) == 0.5  # not all numbers: 1 - score
    flags = [Evaluation(loss=Variable(True), score=1.0)]
    assert train_loss(flags, 1.0) == 0.0  # bool is not a loss value


async def test_an_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    await run_job(LineFit().job, tmp_path, progress=False)
    before = (tmp_path / "checkpoint.json").read_bytes()
    fit = LineFit()
    with pytest.raises(CheckpointError) as info:
        await run_job(fit.job, tmp_path, progress=False)
    assert "already holds a checkpoint" in str(info.value)
    assert "resume=True" in str(info.value) and "overwrite=True" in str(info.value)
    assert (tmp_path / "checkpoint.json").read_bytes() == before
    assert fit.w.data == 0.0
    with pytest.raises(ValueError, match="exclude each other"):
        await run_job(fit.job, tmp_path, resume=True, overwrite=True, progress=False)
    again = await run_job(fit.job, tmp_path, overwrite=True, progress=False)
    assert again.steps_done == STEPS and read_json(tmp_path / "checkpoint.json")["step"] == STEPS


async def test_sigint_during_the_initial_validation_stops_cleanly_and_resume_validates(
    tmp_path: Path,
) -> None:
    full = LineFit()
    uninterrupted = await run_job(full.job, tmp_path / "full", progress=False)
    out = tmp_path / "run"
    seen: list[dict[str, Any]] = []
    fit = LineFit()
    inner = fit.job.forward

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        if not is_grad_enabled() and not seen:  # the first example of the initial validation
            seen.append(read_json(out / "checkpoint.json"))
            os.kill(os.getpid(), signal.SIGINT)
            await anyio.sleep(30)
            pytest.fail("the SIGINT did not cancel the initial validation")
        return await inner(example)

    fit.job.forward = forward
    with anyio.fail_after(30):
        result = await run_job(fit.job, out, progress=False, handle_sigint=True)
    # The step-0 checkpoint was there before the validation started, without its score.
    assert seen[0]["step"] == 0 and seen[0]["initial_val_score"] is None
    assert result.interrupted and result.steps_done == 0 and result.history == []
    assert result.initial_val_score is None
    ckpt = read_json(out / "checkpoint.json")
    assert (ckpt["step"], ckpt["initial_val_score"], ckpt["history"]) == (0, None, [])
    assert read_json(out / "history.json") == {"history": []}
    assert result.plot_path == out / "metrics.png"

    resumed = await run_job(LineFit().job, out, resume=True, progress=False)
    assert resumed.initial_val_score == uninterrupted.initial_val_score == 0.0
    assert resumed.parameters == uninterrupted.parameters
    assert without(resumed.history, TIMING_FIELDS) == without(uninterrupted.history, TIMING_FIELDS)
    assert read_json(out / "checkpoint.json")["initial_val_score"] == 0.0


async def test_a_job_failing_in_its_initial_validation_keeps_the_step_0_checkpoint(
    tmp_path: Path,
) -> None:
    fit = LineFit()

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        raise RuntimeError("judge unavailable")

    fit.job.forward = forward
    with pytest.raises(ExceptionGroup):
        await run_job(fit.job, tmp_path, progress=False, handle_sigint=True)
    assert read_json(tmp_path / "checkpoint.json")["step"] == 0
    assert read_json(tmp_path / "history.json") == {"history": []}


async def test_without_matplotlib_no_plot_is_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = await run_job(LineFit().job, tmp_path, progress=False)
    assert result.plot_path is None
    assert listing(tmp_path) == ["best.json", "checkpoint.json", "history.json", "steps.jsonl"]
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_the_plot_has_a_score_and_a_loss_panel(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from asyncgraph.jobs._report import write_plot

    history: list[dict[str, Any]] = [
        {"step": 1, "train_score": 0.5, "train_loss": 2.0, "val_score": None},
        {"step": 2, "train_score": 1.0, "train_loss": 0.5, "val_score": 0.75},
    ]
    drawn: list[Any] = []
    real_close = plt.close

    def keep(fig: Any = None) -> None:
        drawn.append(fig)
        real_close(fig)

    plt.close = keep  # type: ignore[assignment]
    try:
        assert write_plot(tmp_path / "m.png", history, "job", initial_val=0.25)
    finally:
        plt.close = real_close  # type: ignore[assignment]
    (fig,) = drawn
    score, loss = fig.axes
    assert score.get_ylabel() == "score" and loss.get_ylabel() == "loss"
    lines = {line.get_label(): line for line in score.get_lines()}
    assert list(lines["validation"].get_xdata()) == [0, 2]  # the initial validation at step 0
    assert list(lines["validation"].get_ydata()) == [0.25, 0.75]
    assert list(loss.get_lines()[0].get_ydata()) == [2.0, 0.5]
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)


class _Terminal(io.StringIO):
    """A stand-in for a terminal's stderr: rich draws on it as on a tty."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_a_narrow_terminal_a_long_name_and_the_metrics_are_cut_not_the_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TERM", "xterm-256color")
    fit = LineFit(name="a-job-name-much-longer-than-the-bar-itself")
    await run_job(fit.job, tmp_path, progress=True)
    assert capsys.readouterr().out == ""  # no plain progress lines: the bar is on stderr
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())
    frames = [f for f in re.split(r"[\r\n]+", screen) if f.startswith("a-job-name")]
    assert frames and all(len(f) <= 80 for f in frames), frames
    last = frames[-1]
    assert re.search(r"━ +9/9 \d+:\d\d:\d\d loss \d\.\d\d acc", last), last
    assert last.rstrip().endswith("…") and "…" in last.split()[0], last  # name and metrics cut
