"""Ctrl-C in the middle of a step of ``asyncgraph run``, then ``--resume``.

Each case runs the job file ``job_files/interruptible_job.py`` three ways: once
without interruption (shared), once held inside step K at a given phase and sent
SIGINT there (the job writes a marker file when it is inside the step, so the
signal lands mid-step deterministically, without sleeps), and once resumed with
``--resume``. The interrupted run must exit 130 leaving the checkpoint of step
K; the resumed run must end exactly like the uninterrupted one. Also: Ctrl-C during
the initial validation (before any step: the step-0 checkpoint is already there,
without the initial score, and ``--resume`` runs the validation first), and two
Ctrl-C in a row (the second is ignored while the first one stops the job).

What is compared: the final checkpoint's parameters, optimizer state (TGD's
momentum memory: past prompts and the feedback they got), step, data position,
job identity and initial validation score, and the metrics history without its
wall-clock field ``step_s``. ``tokens`` and ``cost_usd`` are compared too, and
must be equal: the history counts the usage of completed steps only (a resumed
run continues from the checkpointed totals, and the abandoned half of step K
is neither in the checkpoint nor counted again), the simulated model's usage
depends only on the messages, and nothing is cached. They would legitimately
differ with a response cache (the redone part of step K would be free on
resume), with a real model (replies, hence token counts, vary), or when the
backward runs on workers (their calls are not metered in this process).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .jobs_helpers import (
    JOB_FILES,
    PNG_MAGIC,
    REPO,
    TIMING_FIELDS,
    cli_env,
    describe,
    read_json,
    run_cli,
    without,
)

JOB_FILE = str(JOB_FILES / "interruptible_job.py")
TOTAL_STEPS = 12  # 24 questions, batches of 4, 2 epochs
STEPS_PER_EPOCH = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final checkpoint of an uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_cli("run", JOB_FILE, "--out", str(out), "--no-progress")
    assert proc.returncode == 0, describe(proc)
    assert f"finished after {TOTAL_STEPS} step(s)" in proc.stdout
    ckpt: dict[str, Any] = read_json(out / "checkpoint.json")
    # The job learns: the comparison below is not between two runs that did nothing.
    assert ckpt["history"][-1]["val_score"] == 1.0 > ckpt["initial_val_score"]
    return ckpt


def _interrupt_mid_step(
    out: Path, phase: str, step: int, logs: Path, *, sigints: int = 1
) -> tuple[int, str, str]:
    marker = logs / f"marker-{phase}"
    stdout, stderr = logs / f"{phase}.out", logs / f"{phase}.err"
    env = cli_env(AG_TEST_HOLD_STEP=str(step), AG_TEST_HOLD_PHASE=phase, AG_TEST_MARKER=str(marker))
    with stdout.open("w") as out_f, stderr.open("w") as err_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", "run", JOB_FILE, "--out", str(out), "--no-progress"],
            cwd=REPO, env=env, stdout=out_f, stderr=err_f,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 90
            while not marker.exists():
                if proc.poll() is not None:
                    pytest.fail(
                        f"the job exited ({proc.returncode}) before reaching step {step}'s "
                        f"{phase}:\n{stdout.read_text()}\n{stderr.read_text()}"
                    )
                if time.monotonic() > deadline:
                    pytest.fail(f"the job did not reach step {step}'s {phase} within 90 s")
                time.sleep(0.02)
            assert marker.read_text() == f"{phase} {step}\n"
            for _ in range(sigints):  # a second one lands while the first is being handled
                proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return code, stdout.read_text(), stderr.read_text()


@pytest.mark.parametrize(
    ("phase", "step", "sigints"),
    [
        ("forward", 2, 1),
        ("backward", 7, 1),
        ("optimizer", 3, 1),
        ("validation", 0, 1),
        ("backward", 4, 2),
    ],
    ids=[
        "during-forward",
        "during-backward",
        "during-optimizer-step",
        "during-the-initial-validation",
        "twice-during-backward",
    ],
)
@pytest.mark.slow
def test_sigint_mid_step_then_resume_ends_like_an_uninterrupted_run(
    tmp_path: Path, reference: dict[str, Any], phase: str, step: int, sigints: int
) -> None:
    out = tmp_path / "run"
    code, stdout, stderr = _interrupt_mid_step(out, phase, step, tmp_path, sigints=sigints)
    assert code == 130, f"exit code {code}\n{stdout}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert f"interrupted after {step} step(s)" in stdout
    assert "resume with the same command plus --resume" in stdout

    # The checkpoint is the one of the last completed step, with its data position.
    ckpt = read_json(out / "checkpoint.json")
    epoch, index = divmod(step, STEPS_PER_EPOCH)
    assert (ckpt["step"], ckpt["epoch"], ckpt["position"]) == (step, epoch, index * 4)
    assert without(ckpt["history"], TIMING_FIELDS) == without(
        reference["history"][:step], TIMING_FIELDS
    )
    assert read_json(out / "history.json") == {"history": ckpt["history"]}
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    # Interrupted before the initial validation finished: the checkpoint says it is missing.
    want_initial = None if phase == "validation" else reference["initial_val_score"]
    assert ckpt["initial_val_score"] == want_initial

    resumed = run_cli("run", JOB_FILE, "--out", str(out), "--resume")  # with progress lines
    assert resumed.returncode == 0, describe(resumed)
    if step:
        assert f"interruptible-demo: resuming after step {step}/{TOTAL_STEPS}" in resumed.stdout
    assert f"interruptible-demo: step {step + 1}/{TOTAL_STEPS}" in resumed.stdout
    assert f"interruptible-demo: step {step}/{TOTAL_STEPS} " not in resumed.stdout
    assert f"finished after {TOTAL_STEPS} step(s)" in resumed.stdout

    final = read_json(out / "checkpoint.json")
    for key in (
        "step", "epoch", "position", "job", "initial_val_score", "parameters", "module", "optimizer",
    ):  # fmt: skip
        assert final[key] == reference[key], key
    # The same rows, but for what was spent: the calls of the interrupted step were paid,
    # and the rows after the resume count on from the checkpoint's "spent", which has them.
    # (cut_calls too: a call Ctrl-C cut mid-step is counted at its bound, #33.5)
    usage = {"tokens", "cost_usd", "unpriced_calls", "replayed_calls", "cut_calls"}
    assert without(final["history"], TIMING_FIELDS | usage) == without(
        reference["history"], TIMING_FIELDS | usage
    )
    before = reference["history"][step - 1] if step else reference["initial_usage"]
    if phase == "validation":  # the initial validation's calls: none counted before it
        before = {"tokens": 0}
    cut = ckpt["spent"]["tokens"] - before["tokens"]  # what the interrupted step spent
    assert cut > 0
    for got, want in zip(final["history"][step:], reference["history"][step:], strict=True):
        assert got["tokens"] == want["tokens"] + cut
    assert final["history"][:step] == ckpt["history"]
    assert read_json(out / "history.json") == {"history": final["history"]}
