"""``asyncgraph run``: the shipped example job file end to end, and its usage errors."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from .jobs_helpers import PNG_MAGIC, REPO, cli_env, describe, listing, read_json, run_cli

EXAMPLE = str(REPO / "examples" / "prompt_job.py")
FAST = cli_env(PROMPT_JOB_LATENCY_MS="5")


def test_run_the_example_job_file(tmp_path: Path) -> None:
    out = tmp_path / "router"
    proc = run_cli("run", EXAMPLE, "--out", str(out), "--no-progress", env=FAST)
    assert proc.returncode == 0, describe(proc)
    assert "finished after 12 step(s)" in proc.stdout and str(out) in proc.stdout
    assert listing(out) == ["checkpoint.json", "history.json", "metrics.png"]

    ckpt = read_json(out / "checkpoint.json")
    assert ckpt["job"]["name"] == "ticket-router" and ckpt["step"] == 12
    history = ckpt["history"]
    assert read_json(out / "history.json") == {"history": history}
    assert [h["step"] for h in history if h["val_score"] is not None] == [2, 4, 6, 8, 10, 12]
    assert ckpt["initial_val_score"] == 0.0 and history[-1]["val_score"] == 1.0
    assert all(h["tokens"] > 0 for h in history)  # the job reports its model's usage
    assert [h["tokens"] for h in history] == sorted(h["tokens"] for h in history)
    (prompt,) = ckpt["parameters"]
    assert prompt["role"] == "system prompt of the ticket router"
    assert prompt["data"].startswith("You route customer support tickets to the right team.")
    for rule in ("one lowercase label only", "are billing", "are bug", "are account", "are feature"):
        assert rule in prompt["data"]
    assert ckpt["optimizer"]["param_groups"][0]["momentum"] == 2
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)


def test_run_shows_progress_off_a_terminal(tmp_path: Path) -> None:
    proc = run_cli("run", EXAMPLE, "--out", str(tmp_path / "o"), env=FAST)
    assert proc.returncode == 0, describe(proc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ticket-router: step ")]
    assert len(lines) == 12
    for word in ("loss", "acc", "val", "tokens", "$"):
        assert word in lines[-1]


def _run_on_a_terminal(*args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run ``python -m asyncgraph ARGS`` with a pseudo-terminal as stdin/stdout/stderr."""
    master, slave = pty.openpty()
    env = {**FAST, "COLUMNS": "160", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncgraph", *args], cwd=REPO, env=env,
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = b"".join(chunks).decode(errors="replace")
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_run_shows_a_rich_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    code, screen = _run_on_a_terminal("run", EXAMPLE, "--out", str(tmp_path / "o"))
    assert code == 0, screen
    frames = [frame for frame in re.split(r"[\r\n]+", screen) if frame.startswith("ticket-router ")]
    assert frames, screen
    last = frames[-1]
    assert "━" in last and "12/12" in last
    assert re.search(r"loss 0\.00  acc 1\.00  val 1\.00  tokens [\d,]+  \$0\.0000", last), last
    # A step without validation shows the last validation score, not a dash.
    assert not [f for f in frames if "/12" in f and "val -" in f and " 1/12" not in f], frames


def test_resume_from_a_corrupt_checkpoint_exits_2_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.json").write_text('{"format": "asyncgraph-checkpoint", "vers')
    proc = run_cli("run", EXAMPLE, "--out", str(out), "--resume", "--no-progress", env=FAST)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.startswith(f"error: checkpoint {str(out / 'checkpoint.json')!r} is corrupt")
    assert "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert listing(out) == ["checkpoint.json"]  # nothing overwritten


def test_resume_without_a_checkpoint_exits_2(tmp_path: Path) -> None:
    proc = run_cli("run", EXAMPLE, "--out", str(tmp_path / "o"), "--resume", env=FAST)
    assert proc.returncode == 2, describe(proc)
    assert "error: no checkpoint at" in proc.stderr and "run without --resume" in proc.stderr


def test_resume_with_a_checkpoint_of_another_job_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "o"
    done = run_cli("run", EXAMPLE, "--out", str(out), "--no-progress", env=FAST)
    assert done.returncode == 0, describe(done)
    ckpt = read_json(out / "checkpoint.json")
    ckpt["job"]["seed"] = 8  # as if the job file had been run with another seed
    (out / "checkpoint.json").write_text(json.dumps(ckpt))
    proc = run_cli("run", EXAMPLE, "--out", str(out), "--resume", env=FAST)
    assert proc.returncode == 2, describe(proc)
    assert "belongs to a different job: seed is 8 there but 7 now" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_job_file_or_one_without_build_job_exits_2(tmp_path: Path) -> None:
    proc = run_cli("run", str(tmp_path / "nope.py"))
    assert proc.returncode == 2, describe(proc)
    assert "error: job file" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr

    no_factory = tmp_path / "job.py"
    no_factory.write_text("JOB = None\n")
    proc = run_cli("run", str(no_factory), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, describe(proc)
    assert "defines no build_job()" in proc.stderr and "Traceback" not in proc.stderr
