"""``asyncgraph run``: the shipped example job file end to end, on a terminal, on the
workers of a Redis, and its errors (one ``error:`` line, never a traceback)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import uuid
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
    listing,
    read_json,
    run_cli,
    without,
)

EXAMPLE = str(REPO / "examples" / "prompt_job.py")
FAST = cli_env(PROMPT_JOB_LATENCY_MS="5")


@pytest.mark.slow
def test_run_the_example_job_file(tmp_path: Path) -> None:
    out = tmp_path / "router"
    proc = run_cli("run", EXAMPLE, "--out", str(out), "--no-progress", env=FAST)
    assert proc.returncode == 0, describe(proc)
    assert "finished after 12 step(s)" in proc.stdout and str(out) in proc.stdout
    assert listing(out) == [
        "best.json",
        "checkpoint.json",
        "history.json",
        "metrics.png",
        "steps.jsonl",
    ]

    ckpt = read_json(out / "checkpoint.json")
    assert ckpt["job"]["name"] == "ticket-router" and ckpt["step"] == 12
    history = ckpt["history"]
    assert read_json(out / "history.json") == {"history": history}
    assert [h["step"] for h in history if h["val_score"] is not None] == [2, 4, 6, 8, 10, 12]
    assert ckpt["initial_val_score"] == 0.0 and history[-1]["val_score"] == 1.0
    assert all(h["tokens"] > 0 for h in history)  # the job reports its model's usage
    assert [h["tokens"] for h in history] == sorted(h["tokens"] for h in history)
    # The job's TicketRouter Module: its parameters' names and roles, and its state_dict.
    assert ckpt["parameters"] == [{"name": "prompt", "role": "system prompt of the ticket router"}]
    prompt = ckpt["module"]["prompt"]
    assert prompt.startswith("You route customer support tickets to the right team.")
    for rule in (
        "one lowercase label only",
        "are billing",
        "are bug",
        "are account",
        "are feature",
    ):
        assert rule in prompt
    assert ckpt["optimizer"]["param_groups"][0]["momentum"] == 2
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_run_shows_progress_off_a_terminal(tmp_path: Path) -> None:
    proc = run_cli("run", EXAMPLE, "--out", str(tmp_path / "o"), env=FAST)
    assert proc.returncode == 0, describe(proc)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ticket-router: step ")]
    assert len(lines) == 12
    for word in ("loss", "acc", "val", "tokens", "$"):
        assert word in lines[-1]


def _run_on_a_terminal(
    *args: str, columns: int, stdout: Path | None = None, timeout_s: float = 120.0
) -> tuple[int, str]:
    """Run ``python -m asyncgraph ARGS`` with a pseudo-terminal ``columns`` wide as
    stdin/stdout/stderr (stdout to the file ``stdout`` if given); its exit code and
    what the terminal showed (escapes removed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**FAST, "COLUMNS": str(columns), "TERM": "xterm-256color"}
    with contextlib.ExitStack() as files:
        out: Any = files.enter_context(stdout.open("w")) if stdout is not None else slave
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", *args],
            cwd=REPO,
            env=env,
            stdin=slave,
            stdout=out,
            stderr=slave,
        )
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


@pytest.mark.parametrize(
    ("columns", "stdout_to_a_file"),
    [(80, False), (160, True)],
    ids=["80-columns", "stdout-to-a-file"],
)
@pytest.mark.slow
def test_run_shows_a_rich_progress_bar_on_a_terminal(
    tmp_path: Path, columns: int, stdout_to_a_file: bool
) -> None:
    stdout = tmp_path / "stdout" if stdout_to_a_file else None
    code, screen = _run_on_a_terminal(
        "run", EXAMPLE, "--out", str(tmp_path / "o"), columns=columns, stdout=stdout
    )
    assert code == 0, screen
    if stdout is not None:
        # The bar went to stderr (the terminal that chose it); stdout has the summary only.
        printed = stdout.read_text()
        assert "finished after 12 step(s)" in printed and "ticket-router" not in printed, printed
        assert "finished after" not in screen
    frames = [frame for frame in re.split(r"[\r\n]+", screen) if frame.startswith("ticket-router ")]
    assert frames, screen
    last = frames[-1]
    # Bar, M/N and elapsed time stay visible, and the frame fits the terminal.
    assert "━" in last and "12/12" in last, last
    assert re.search(r"12/12 +\d+:\d\d:\d\d ", last), last
    assert all(len(frame) <= columns for frame in frames), [f for f in frames if len(f) > columns]
    assert "loss 0.00 acc 1.00 val 1.00" in last, last
    if columns >= 120:  # the whole metrics text fits
        assert re.search(r"val 1\.00 [\d,.]+k? tok \$0$", last.rstrip()), last  # simulated: free
    else:
        assert last.rstrip().endswith("…") or "tok" in last, last
    # A step without validation shows the last validation score, not a dash.
    assert not [f for f in frames if "/12" in f and "val -" in f and " 1/12" not in f], frames
    assert "Traceback" not in screen


@pytest.mark.slow
def test_resume_from_a_corrupt_checkpoint_exits_2_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.json").write_text('{"format": "asyncgraph-checkpoint", "vers')
    proc = run_cli("run", EXAMPLE, "--out", str(out), "--resume", "--no-progress", env=FAST)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.startswith(f"error: checkpoint {str(out / 'checkpoint.json')!r} is corrupt")
    assert "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert listing(out) == ["checkpoint.json"]  # nothing overwritten


@pytest.mark.slow
def test_resume_without_a_checkpoint_exits_2(tmp_path: Path) -> None:
    proc = run_cli("run", EXAMPLE, "--out", str(tmp_path / "o"), "--resume", env=FAST)
    assert proc.returncode == 2, describe(proc)
    assert "error: no checkpoint at" in proc.stderr and "run without --resume" in proc.stderr


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- Errors are one line, not a traceback (in-process: ``asyncgraph.cli.main``) ----------


def _main(*args: str) -> int:
    from asyncgraph.cli import main

    try:
        return main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0)


@pytest.fixture
def fast_example(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PROMPT_JOB_LATENCY_MS", "1")
    return EXAMPLE


def test_rerunning_into_a_checkpoint_needs_resume_or_overwrite(
    tmp_path: Path, fast_example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.json").write_text('{"an": "old checkpoint"}')
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {str(out / 'checkpoint.json')!r} holds the checkpoint of an earlier run"
    )
    assert "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert "resume=True" not in err  # the command line's words, not the API's
    assert listing(out) == ["checkpoint.json"]  # untouched
    assert (out / "checkpoint.json").read_text() == '{"an": "old checkpoint"}'

    assert _main("run", fast_example, "--out", str(out), "--no-progress", "--overwrite") == 0
    assert read_json(out / "checkpoint.json")["step"] == 12
    assert _main("run", fast_example, "--out", str(out), "--resume", "--overwrite") == 2  # usage


def test_without_matplotlib_the_summary_does_not_claim_a_plot(
    tmp_path: Path,
    fast_example: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 0
    captured = capsys.readouterr()
    assert "finished after 12 step(s)" in captured.out
    assert f"checkpoint and history.json in {out}" in captured.out
    assert "metrics.png" not in captured.out
    assert "matplotlib is not installed" in captured.err
    assert listing(out) == ["best.json", "checkpoint.json", "history.json", "steps.jsonl"]


def test_resume_from_a_checkpoint_with_a_damaged_history_row_exits_2(
    tmp_path: Path, fast_example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 0
    ckpt = read_json(out / "checkpoint.json")
    del ckpt["history"][3]["train_score"]
    (out / "checkpoint.json").write_text(json.dumps(ckpt))
    capsys.readouterr()
    assert _main("run", fast_example, "--out", str(out), "--resume", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "history row 3 has no field 'train_score'" in err


def test_an_asyncgraph_error_in_the_job_is_one_line(
    tmp_path: Path,
    fast_example: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # build_job() fails with UnknownModelError (resolve_model of an unknown spec).
    monkeypatch.setenv("PROMPT_JOB_MODEL", "no-such-model")
    assert _main("run", fast_example, "--out", str(tmp_path / "o"), "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" in err and "Traceback" not in err


def test_a_model_error_inside_the_concurrent_forward_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The forward's task group raises an ExceptionGroup holding the ModelConnectionError.
    job_file = tmp_path / "failing_job.py"
    job_file.write_text(
        "from asyncgraph import Parameter\n"
        "from asyncgraph.jobs import Job\n"
        "from asyncgraph.models import ModelConnectionError\n"
        "from asyncgraph.optim import SGD\n\n"
        "def build_job():\n"
        "    w = Parameter(0.0, role='w')\n"
        "    async def forward(example):\n"
        "        raise ModelConnectionError('cannot reach http://model.invalid: refused')\n"
        "    return Job(name='failing', parameters=[w], optimizer=SGD([w]), forward=forward,\n"
        "               train_set=[{'x': 1}] * 4, batch_size=2)\n"
    )
    out = tmp_path / "o"
    assert _main("run", str(job_file), "--out", str(out), "--no-progress") == 1
    err = capsys.readouterr().err
    assert err == (
        "error: cannot reach http://model.invalid: refused\n"
        f"no step completed, so {out} holds nothing to resume: the same command runs the job "
        "again from the start\n"
    )
    assert listing(out) == [
        "checkpoint.json",
        "history.json",
        "metrics.png",
        "steps.jsonl",
    ]  # step 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--redis", "http://not-redis"], "invalid Redis URL"),
        (["--redis", "redis://127.0.0.1:6379/0", "--queue", "no spaces"], "queue name must be"),
    ],
    ids=["bad-url", "bad-queue"],
)
def test_bad_redis_options_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert _main("run", EXAMPLE, "--out", str(tmp_path / "o"), *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


def test_run_on_a_redis_without_live_workers_fails_fast(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:  # a worker that died a minute ago: its heartbeat entry expired
        (now_s, _us) = client.time()
        client.hset("asyncgraph:{lonely}:workers", "dead-worker", (now_s - 60) * 1000)
    finally:
        client.close()
    out = tmp_path / "o"
    assert _main("run", EXAMPLE, "--redis", redis_url, "--queue", "lonely", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no worker of queue 'lonely' is alive: start one with")
    assert "asyncgraph worker --redis URL --queue lonely" in err
    assert not out.exists()  # refused before the job started


def test_run_on_an_unreachable_redis_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.distributed._redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    assert _main("run", EXAMPLE, "--redis", url, "--out", str(tmp_path / "o")) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach Redis at {url}") and "Traceback" not in err


def test_run_on_the_workers_of_a_redis_matches_the_in_process_run(
    tmp_path: Path, redis_url: str
) -> None:
    from asyncgraph.distributed._fleet import local_fleet
    from asyncgraph.jobs._demo_cli import WORKER_IMPORTS

    job_file = str(JOB_FILES / "demo_job.py")
    env = cli_env(ASYNCGRAPH_DEMO_LATENCY_MS="5")
    local = run_cli("run", job_file, "--out", str(tmp_path / "local"), "--no-progress", env=env)
    assert local.returncode == 0, describe(local)
    queue = f"ag-run-test-{uuid.uuid4().hex[:8]}"
    saved = os.environ.get("ASYNCGRAPH_DEMO_LATENCY_MS")
    os.environ["ASYNCGRAPH_DEMO_LATENCY_MS"] = "5"  # the workers' "demo" model
    try:
        with local_fleet(2, WORKER_IMPORTS, redis_url=redis_url, queue=queue):
            remote = run_cli(
                "run",
                job_file,
                "--redis",
                redis_url,
                "--queue",
                queue,
                "--out",
                str(tmp_path / "remote"),
                "--no-progress",
                env=env,
            )
    finally:
        if saved is None:
            os.environ.pop("ASYNCGRAPH_DEMO_LATENCY_MS", None)
        else:
            os.environ["ASYNCGRAPH_DEMO_LATENCY_MS"] = saved
    assert remote.returncode == 0, describe(remote)
    assert "finished after 3 step(s)" in remote.stdout
    want, got = (
        read_json(tmp_path / "local" / "checkpoint.json"),
        read_json(tmp_path / "remote" / "checkpoint.json"),
    )
    for key in ("step", "job", "initial_val_score", "parameters", "module", "optimizer"):
        assert got[key] == want[key], key
    # Tokens and cost included: the workers report the usage of the calls they made.
    assert without(got["history"], TIMING_FIELDS) == without(want["history"], TIMING_FIELDS)
    assert got["history"][-1]["tokens"] > 0


# --- Paper cuts: job-file problems, run directories, resume and the end of a run ----------


@pytest.mark.slow
def test_run_given_a_directory_says_it_is_a_directory(tmp_path: Path) -> None:
    proc = run_cli("run", str(tmp_path))
    assert proc.returncode == 2, describe(proc)
    assert "is a directory, not a job file" in proc.stderr
    assert "does not exist" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_syntax_error_in_a_job_file_is_one_line_with_a_caret(tmp_path: Path) -> None:
    job_file = tmp_path / "broken.py"
    job_file.write_text("def build_job():\n    return Job(name='x',,)\n")
    proc = run_cli("run", str(job_file), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, describe(proc)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"error: {job_file}:2:") and "SyntaxError" in lines[0]
    assert lines[1].strip() == "return Job(name='x',,)"
    assert lines[2].strip() == "^"
    # The caret stands under the second comma.
    assert lines[2].index("^") - lines[1].index("r") == len("return Job(name='x',")
    assert "Traceback" not in proc.stderr and len(lines) == 3


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (
            "import no_such_module_here\n",
            ["raised ModuleNotFoundError while it was imported", ":1)"],
        ),
        ("X = 1\nY = 1 / 0\n", ["raised ZeroDivisionError while it was imported", ":2)"]),
        ("def build_job():\n    return 42\n", ["must return an asyncgraph.jobs.Job", "int: 42"]),
        (
            "def build_job():\n    raise ValueError('no data set at /data')\n",
            ["build_job() in", "raised ValueError", ":2): no data set at /data"],
        ),
        ("async def build_job():\n    return None\n", ["must return", "NoneType"]),
    ],
    ids=["import-error", "error-at-import", "wrong-type", "build-job-raises", "async-none"],
)
@pytest.mark.slow
def test_any_problem_in_a_job_file_is_one_line(
    tmp_path: Path, source: str, words: list[str]
) -> None:
    job_file = tmp_path / "job.py"
    job_file.write_text(source)
    proc = run_cli("run", str(job_file), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    for word in words:
        assert word in proc.stderr
    assert "Traceback" not in proc.stderr and "anyio" not in proc.stderr


def test_the_end_of_a_run_shows_the_final_parameters(
    tmp_path: Path, fast_example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 0
    printed = capsys.readouterr().out
    tail = printed[printed.index("final parameters:") :]
    prompt = read_json(out / "checkpoint.json")["module"]["prompt"]
    assert f"  prompt: {prompt[:300]}" in tail


def test_resuming_a_finished_job_says_so_and_rewrites_nothing(
    tmp_path: Path, fast_example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert _main("run", fast_example, "--out", str(out), "--resume", "--no-progress") == 0
    printed = capsys.readouterr().out
    assert "already finished (12 step(s)); nothing to do" in printed
    assert "--overwrite starts it over" in printed
    assert "ticket-router: step" not in printed and "final parameters" not in printed
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_resuming_says_after_which_step(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncgraph.jobs._report import Reporter

    row = {"step": 2, "val_score": None, "train_score": 0.5, "train_loss": 0.5}
    Reporter("demo-prompt-optimization", 6).start(2, [row])
    assert capsys.readouterr().out == "demo-prompt-optimization: resuming after step 2/6\n"


@pytest.mark.slow
def test_without_out_the_run_directory_is_announced(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()  # a git work tree without runs/ in its .gitignore
    env = cli_env(PROMPT_JOB_LATENCY_MS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "run", EXAMPLE, "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, describe(proc)
    first = proc.stdout.splitlines()[0]
    assert first == (
        "run directory: runs/ticket-router/ (the default; --out DIR to choose); "
        "add 'runs/' to your .gitignore"
    )
    assert (tmp_path / "runs" / "ticket-router" / "checkpoint.json").is_file()
    (tmp_path / ".gitignore").write_text("runs/\n")
    proc = subprocess.run(
        [sys.executable, "-m", "asyncgraph", "run", EXAMPLE, "--no-progress", "--overwrite"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, describe(proc)
    assert proc.stdout.splitlines()[0].endswith("(the default; --out DIR to choose)")


def test_max_attempts_is_a_flag_and_an_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_example: str
) -> None:
    from asyncgraph.models import ModelConfigError, parse_model_spec

    monkeypatch.setenv("ASYNCGRAPH_MODEL_MAX_ATTEMPTS", "2")
    assert parse_model_spec("simulated").retry.max_attempts == 2
    monkeypatch.setenv("ASYNCGRAPH_MODEL_MAX_ATTEMPTS", "zero")
    with pytest.raises(ModelConfigError, match="ASYNCGRAPH_MODEL_MAX_ATTEMPTS='zero'"):
        parse_model_spec("simulated")
    monkeypatch.delenv("ASYNCGRAPH_MODEL_MAX_ATTEMPTS")
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--max-attempts", "0") == 2
    assert (
        _main("run", fast_example, "--out", str(out), "--no-progress", "--max-attempts", "1") == 0
    )
    assert os.environ["ASYNCGRAPH_MODEL_MAX_ATTEMPTS"] == "1"
    monkeypatch.delenv("ASYNCGRAPH_MODEL_MAX_ATTEMPTS")


@pytest.mark.slow
def test_demo_help_explains_every_option() -> None:
    proc = run_cli("demo", "--help")
    assert proc.returncode == 0
    assert "passes over the 24 training questions" in proc.stdout
    assert "--max-attempts N" in proc.stdout


FLAKY_JOB = """
from asyncgraph import Parameter
from asyncgraph.jobs import Evaluation, Job
from asyncgraph.models import BaseChatModel, Completion, ModelConnectionError, Retry
from asyncgraph.optim import SGD


class Flaky(BaseChatModel):
    def __init__(self):
        super().__init__("flaky", retry=Retry(backoff_base_s=0.001, backoff_max_s=0.001))
        self.calls = 0

    async def _complete_once(self, messages, params):
        self.calls += 1
        if self.calls == 1:
            raise ModelConnectionError("connection reset by the test", model="flaky")
        return Completion("ok", model="flaky")


MODEL = Flaky()


def build_job():
    w = Parameter(0.0, role="w")

    async def forward(example):
        await MODEL.complete([{"role": "user", "content": "hi"}])
        return Evaluation(loss=w, score=1.0)

    return Job(name="flaky", parameters=[w], optimizer=SGD([w]), forward=forward,
               train_set=[{"x": 1}], batch_size=1)
"""


@pytest.mark.parametrize(
    ("flags", "shown"), [((), False), (("-v",), True), (("--log-level", "info"), True)]
)
@pytest.mark.slow
def test_verbose_shows_model_retries(tmp_path: Path, flags: tuple[str, ...], shown: bool) -> None:
    job_file = tmp_path / "flaky_job.py"
    job_file.write_text(FLAKY_JOB)
    proc = run_cli("run", str(job_file), "--out", str(tmp_path / "o"), "--no-progress", *flags)
    assert proc.returncode == 0, describe(proc)
    line = "flaky: attempt 1 failed (ModelConnectionError: connection reset by the test)"
    assert (line in proc.stderr) is shown, proc.stderr


@pytest.mark.slow
def test_a_bad_log_level_is_a_usage_error() -> None:
    proc = run_cli("demo", "--log-level", "LOUD")
    assert proc.returncode == 2
    assert proc.stderr.startswith("asyncgraph demo: error: argument --log-level: invalid choice")
    assert "'LOUD'" in proc.stderr and "(see 'asyncgraph demo --help')" in proc.stderr


def test_resuming_a_finished_job_on_workers_starts_no_fleet(
    tmp_path: Path,
    fast_example: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``run --workers N --resume`` of a finished run says so at once: no redis-server and
    no worker is started for nothing (here none could be: PATH holds no server)."""
    out = tmp_path / "o"
    assert _main("run", fast_example, "--out", str(out), "--no-progress") == 0
    capsys.readouterr()
    monkeypatch.setenv("ASYNCGRAPH_REDIS_SERVER", "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    args = ["run", fast_example, "--out", str(out), "--no-progress"]
    assert _main(*args, "--workers", "2", "--resume") == 0
    captured = capsys.readouterr()
    assert "already finished (12 step(s)); nothing to do" in captured.out, captured
    assert "no redis-server found" not in captured.err
