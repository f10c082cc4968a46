"""``asyncgraph run`` prints the best parameters; ``asyncgraph eval JOB --params best.json``
scores them on a split (in-process: the command's main, no subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgraph.cli import main

JOB = str(Path(__file__).resolve().parent / "job_files" / "best_job.py")


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0)


@pytest.fixture
def run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "run"
    assert cli("run", JOB, "--out", str(out), "--no-progress") == 0
    printed = capsys.readouterr().out
    assert f"best validation score 0.60 (after step 3): {out / 'best.json'}" in printed
    tail = printed[printed.index("best parameters:") :]
    assert "  prompt: v3" in tail
    assert "final parameters:\n  prompt: v3" in printed  # keep_best: the job ends on its best
    return out


def test_eval_scores_best_json_on_the_test_split_by_default(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", JOB, "--params", str(run_dir / "best.json")) == 0
    out = capsys.readouterr().out
    assert f"parameters: {run_dir / 'best.json'} (step 3, validation 0.60)" in out
    assert "split: test (4 examples)" in out and "score: 0.7500" in out


def test_eval_other_splits_and_other_files(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", JOB, "--params", str(run_dir / "best.json"), "--split", "val") == 0
    assert "split: val (2 examples)" in (out := capsys.readouterr().out)
    assert "score: 0.6000" in out
    assert cli("eval", JOB, "--split", "train") == 0  # no --params: build_job()'s values
    out = capsys.readouterr().out
    assert "parameters: the values build_job() gives" in out and "score: 0.5000" in out
    assert cli("eval", JOB, "--params", str(run_dir / "checkpoint.json")) == 0
    assert "score: 0.7500" in capsys.readouterr().out  # the checkpoint ends on v3 too


def test_eval_defaults_to_val_without_a_test_set(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BEST_JOB_NO_TEST", "1")
    assert cli("eval", JOB, "--params", str(run_dir / "best.json")) == 0
    assert "split: val (2 examples)" in capsys.readouterr().out
    assert cli("eval", JOB, "--split", "test") == 2
    err = capsys.readouterr().err
    assert "has no test examples" in err and "--split val or --split train" in err


def test_eval_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("eval", JOB, "--params", str(tmp_path / "none.json")) == 2
    assert "no such file" in capsys.readouterr().err
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"format": "asyncgraph-best", "module": {"other": "x"}}')
    assert cli("eval", JOB, "--params", str(wrong)) == 2
    assert "does not hold parameters of job 'best-job'" in capsys.readouterr().err
    assert cli("eval", str(tmp_path / "missing.py")) == 2
    assert cli("eval", JOB, "--split", "nope") == 2


@pytest.mark.parametrize(
    ("field", "value"), [("val_score", "high"), ("step", "3"), ("step", -1), ("val_score", [1])]
)
def test_a_best_json_with_a_field_of_the_wrong_type_is_one_clear_error(
    run_dir: Path, capsys: pytest.CaptureFixture[str], field: str, value: object
) -> None:
    import json

    best = json.loads((run_dir / "best.json").read_text())
    best[field] = value
    bad = run_dir / "bad-best.json"
    bad.write_text(json.dumps(best))
    assert cli("eval", JOB, "--params", str(bad)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {str(bad)!r} is corrupt") and "Traceback" not in err


def test_a_best_json_whose_validation_was_not_measured_is_shown_so(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    best = json.loads((run_dir / "best.json").read_text())
    best["val_score"] = None
    unmeasured = run_dir / "unmeasured-best.json"
    unmeasured.write_text(json.dumps(best))
    assert cli("eval", JOB, "--params", str(unmeasured)) == 0
    assert "(step 3, validation not measured)" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_wall_time_counts_the_whole_command(run_dir: Path, tmp_path: Path) -> None:
    """The wall time eval prints is the command's, from the process's start: here a
    process that spends 1.5 s before the CLI starts prints at least that (it printed the
    evaluation's few milliseconds, "wall time: 0.0s", for a 1.1 s command)."""
    import subprocess
    import sys

    code = (
        "import sys, time; time.sleep(1.5); from asyncgraph.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", code, "eval", JOB, "--params", str(run_dir / "best.json")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("wall time: "))
    assert float(line.split()[2].rstrip("s")) >= 1.5, line
