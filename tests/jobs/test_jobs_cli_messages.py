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
    # No step completed: nothing to resume, and the same command runs the job again.
    assert "--resume" not in proc.stderr, proc.stderr
    assert "no step completed" in proc.stderr and "the same command runs the job again" in (
        proc.stderr
    )
    checkpoint = json.loads((out / "checkpoint.json").read_text())
    assert checkpoint["step"] == 0
    again = run_cli("run", str(JOB_FILES / "no_model_job.py"), "--out", str(out), "--no-progress")
    assert again.returncode == 1, describe(again)  # the same failure, not "holds a checkpoint"
    assert "holds the checkpoint of an earlier run" not in again.stderr, again.stderr
    assert "LLMCall needs a model" in again.stderr


BAD_SPEC_JOB = """
from asyncgraph import Module, Parameter, Variable
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.optim import TGD
from asyncgraph.text import llm_call, set_default_models

set_default_models("gpt-4o-mini")


class Program(Module):
    def __init__(self):
        super().__init__()
        self.prompt = Parameter("Label the number.", role="system prompt")

    async def forward(self, example):
        answer = await llm_call(self.prompt, Variable(str(example["n"]), role="number"))
        return Evaluation(loss=answer, score=0.0)


def build_job():
    program = Program()
    data = [{"n": n} for n in range(4)]
    return Job(name="bad-spec", parameters=program, forward=program,
               optimizer=TGD(program.parameters()), train_set=data, val_set=data,
               batch_size=2, epochs=1)
"""


def test_a_model_name_that_names_no_model_fails_first_leading_with_the_fix(
    tmp_path: Path,
) -> None:
    """set_default_models("gpt-4o-mini"): one line that starts with "write
    'openai:gpt-4o-mini'", before any call or file; after the fix the same command runs."""
    job_file = tmp_path / "job.py"
    job_file.write_text(BAD_SPEC_JOB)
    out = tmp_path / "runs" / "x"
    proc = run_cli("run", str(job_file), "--out", str(out), "--no-progress")
    assert proc.returncode == 1, describe(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(
        "error: model spec 'gpt-4o-mini' names no provider: write 'openai:gpt-4o-mini'"
    ), errors[0]
    assert "found at the default model" in errors[0]
    assert "--resume" not in proc.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    job_file.write_text(BAD_SPEC_JOB.replace('"gpt-4o-mini"', '"simulated"'))
    fixed = run_cli("run", str(job_file), "--out", str(out), "--no-progress")
    assert fixed.returncode == 0, describe(fixed)


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
