"""What the command line says when a step fails, when a run exists, when it is done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .jobs_helpers import JOB_FILES, describe, run_cli

pytestmark = pytest.mark.slow  # each test runs the command in a subprocess


def test_a_step_whose_concurrent_forward_fails_is_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("run", str(JOB_FILES / "no_model_job.py"), "--out", str(out), "--no-progress")
    assert proc.returncode == 1, describe(proc)
    assert "Traceback" not in proc.stderr and "ExceptionGroup" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    (error,) = errors
    assert error.startswith("error: TypeError: LLMCall needs a model and none is set")
    assert "(at no_model_job.py:" in error and "in forward)" in error  # where, in the job file
    assert error.endswith("; and 3 more errors in the same step")
    assert "continue with the same command plus --resume" in proc.stderr
    # The checkpoint is the last whole step's (the seed's evaluation failed: step 0).
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["step"] == 0


def test_an_earlier_run_is_named_in_the_command_lines_words(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_cli(
        "demo", "--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)
    )
    assert first.returncode == 0, describe(first)
    again = run_cli(
        "demo", "--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)
    )
    assert again.returncode == 2, describe(again)
    assert "holds the checkpoint of an earlier run: continue it with --resume" in again.stderr
    assert "resume=True" not in again.stderr and "overwrite=True" not in again.stderr
    # demo --resume of a finished run says what run --resume says.
    done = run_cli(
        "demo", "--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out), "--resume"
    )
    assert done.returncode == 0, describe(done)
    assert "already finished (3 step(s)); nothing to do" in done.stdout
    assert "wall time" not in done.stdout and "model calls: 0" not in done.stdout


def test_error_lines_are_redacted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncgraph.jobs._cli_common import _report, _report_first, usage_error

    monkeypatch.setenv("OPENAI_API_KEY", "env-key-0123456789")
    error = RuntimeError("redis://:cli-pass-1@h/0?password=cli-pass-2 echoed env-key-0123456789")
    usage_error(str(error))
    _report([error])
    _report_first([error])
    err = capsys.readouterr().err
    assert err.count("error: ") == 3 and "redis://:***@h/0?password=***" in err
    for secret in ("cli-pass-1", "cli-pass-2", "env-key-0123456789"):
        assert secret not in err
