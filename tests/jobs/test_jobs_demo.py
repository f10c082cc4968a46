"""``asyncgraph demo`` end to end in a subprocess: in-process, on 2 local workers
(embedded redis-server), on the workers of an existing Redis, and against an
OpenAI-compatible endpoint.

The distributed runs must give the same final prompt, optimizer state and metrics
as the in-process run. Compared: the checkpoint's parameters, optimizer state,
step/position and initial validation score, and every history row without
``step_s`` (wall clock). Tokens and cost match too: the workers report the usage
of the model calls they make for the job (``track_usage``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from asyncgraph.distributed._fleet import local_fleet
from asyncgraph.jobs._demo_cli import WORKER_IMPORTS
from asyncgraph.jobs.demo import INITIAL_PROMPT, INSTRUCTIONS, demo_responder
from asyncgraph.models._testing import OpenAITestServer, Reply

from .jobs_helpers import (
    PNG_MAGIC,
    REPO,
    TIMING_FIELDS,
    cli_env,
    describe,
    read_json,
    run_cli,
    without,
)

# The simulated model is free by definition, a model the price table does not know is not.
NOT_COMPARABLE = TIMING_FIELDS | {"unpriced_calls"}
ACCURACY_ROW = re.compile(r"validation accuracy.*?│\s*0%\s*│\s*100%\s*│")


def _check_table(stdout: str) -> None:
    assert "asyncgraph demo: before / after" in stdout
    assert ACCURACY_ROW.search(stdout), stdout
    assert "system prompt" in stdout and "You are a helpful" in stdout
    assert "steps: 6" in stdout


def _check_learned(out: Path) -> dict[str, Any]:
    ckpt: dict[str, Any] = read_json(out / "checkpoint.json")
    # The job's DemoProgram Module: its state_dict, and its parameters' names and roles.
    assert ckpt["parameters"] == [
        {"name": "system_prompt", "role": "system prompt of the question answerer"}
    ]
    prompt = ckpt["module"]["system_prompt"]
    assert prompt.startswith(INITIAL_PROMPT)
    for instruction in INSTRUCTIONS.values():
        assert instruction in prompt
    assert ckpt["initial_val_score"] == 0.0 and ckpt["history"][-1]["val_score"] == 1.0
    assert read_json(out / "history.json") == {"history": ckpt["history"]}
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    return ckpt


def _assert_same_run(
    ckpt: Mapping[str, Any],
    local: Mapping[str, Any],
    *,
    config: frozenset[str] = frozenset(),
    history: frozenset[str] = frozenset(),
) -> None:
    """Same outcome; the job's ``config`` may differ only in the settings named in ``config``,
    the history rows in the fields named in ``history``."""
    for key in (
        "step", "epoch", "position", "initial_val_score", "parameters", "module", "optimizer",
    ):  # fmt: skip
        assert ckpt[key] == local[key], key
    assert without([ckpt["job"]], frozenset({"config"})) == without(
        [local["job"]], frozenset({"config"})
    )
    assert without([ckpt["job"]["config"]], config) == without([local["job"]["config"]], config)
    ignored = NOT_COMPARABLE | history
    assert without(ckpt["history"], ignored) == without(local["history"], ignored)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(text.encode() in arg for arg in args):
            found.append(b" ".join(args).decode(errors="replace"))
    return found


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``asyncgraph demo --latency-ms 10 --out DIR``: the in-process reference."""
    out = tmp_path_factory.mktemp("demo-local")
    proc = run_cli("demo", "--no-progress", "--latency-ms", "10", "--out", str(out))
    assert proc.returncode == 0, describe(proc)
    _check_table(proc.stdout)
    assert "executor: in-process" in proc.stdout
    assert f"checkpoint, history.json and metrics.png: {out}" in proc.stdout
    assert "discarded" not in proc.stdout
    ckpt = _check_learned(out)
    assert ckpt["job"]["optimizer"] == "TGD"
    assert ckpt["job"]["config"] == {
        "model": "demo", "base_url": None, "latency_ms": 10.0, "epochs": 2, "batch_size": 8,
        "optimizer": {"name": "TGD", "momentum": 2, "max_feedback_tokens": 4000, "constraints": []},
    }  # fmt: skip
    return ckpt


@pytest.mark.slow
def test_demo_without_arguments(tmp_path: Path) -> None:
    # Exactly what a user types: simulated model at 100 ms a call, progress, a temp dir.
    proc = run_cli("demo", timeout_s=120)
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert (
        "Model: SIMULATED (offline, scripted replies, not a language model; 100 ms per call)" in out
    )
    assert "executor: in-process" in out
    progress = [
        line for line in out.splitlines() if line.startswith("demo-prompt-optimization: step ")
    ]
    assert len(progress) == 6 and "tokens" in progress[-1] and "acc 1.00" in progress[-1]
    _check_table(out)
    assert (
        "checkpoint, history.json and metrics.png went to a temporary directory and are "
        "discarded (pass --out DIR to keep them)"
    ) in out
    assert "asyncgraph-demo-" not in out  # the temporary directory is gone: not worth naming
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_demo_local_run_learns_every_instruction(local_run: dict[str, Any]) -> None:
    history = local_run["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["epoch"] for h in history] == [0, 0, 0, 1, 1, 1]
    assert all(h["val_score"] is not None for h in history)
    assert history[0]["train_score"] < history[-1]["train_score"] == 1.0
    assert 0 < history[0]["tokens"] < history[-1]["tokens"]


def test_demo_on_two_local_workers_matches_the_local_run(
    tmp_path: Path, local_run: dict[str, Any], redis_server_binary: None
) -> None:
    queue = f"ag-demo-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    proc = run_cli(
        "demo", "--workers", "2", "--queue", queue, "--no-progress", "--latency-ms", "10",
        "--out", str(out), timeout_s=180,
    )  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    _check_table(proc.stdout)
    assert "executor: 2 local worker processes via an embedded redis-server" in proc.stdout
    assert "model calls: 422 (the workers' included)" in proc.stdout
    # The summary says when workers pay (#38: a fleet on one machine is slower here).
    assert "note: on one machine the simulated demo runs faster in-process" in proc.stdout
    ckpt = _check_learned(out)
    _assert_same_run(ckpt, local_run)  # tokens included: the workers report theirs
    # The fleet is torn down when the demo ends.
    deadline = time.monotonic() + 15
    while (left := _processes_mentioning(queue)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def test_demo_on_the_workers_of_an_existing_redis_matches_the_local_run(
    tmp_path: Path, redis_url: str, local_run: dict[str, Any]
) -> None:
    queue = f"ag-demo-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    saved = os.environ.get("ASYNCGRAPH_DEMO_LATENCY_MS")
    os.environ["ASYNCGRAPH_DEMO_LATENCY_MS"] = "10"  # the workers' "demo" model
    try:
        with local_fleet(2, WORKER_IMPORTS, redis_url=redis_url, queue=queue):
            proc = run_cli(
                "demo", "--redis", redis_url, "--queue", queue, "--no-progress",
                "--latency-ms", "10", "--out", str(out), timeout_s=180,
            )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("ASYNCGRAPH_DEMO_LATENCY_MS", None)
        else:
            os.environ["ASYNCGRAPH_DEMO_LATENCY_MS"] = saved
    assert proc.returncode == 0, describe(proc)
    assert f"executor: workers of {redis_url}" in proc.stdout
    _check_table(proc.stdout)
    _assert_same_run(_check_learned(out), local_run)


@pytest.mark.slow
def test_demo_against_an_openai_compatible_endpoint(
    tmp_path: Path, local_run: dict[str, Any]
) -> None:
    # A real HTTP server speaking the chat completions protocol, answering like the
    # demo's scripted model: the run must take the same path as the simulated one.
    def answer(body: Any) -> Reply:
        return Reply(text=demo_responder(body["messages"]))

    out = tmp_path / "out"
    with OpenAITestServer(handler=answer) as server:
        url = server.url
        proc = run_cli(
            "demo", "--model", "openai:test-model", "--base-url", url, "--no-progress",
            "--out", str(out), env=cli_env(OPENAI_API_KEY="test-key"),
        )  # fmt: skip
        requests = server.requests
    assert proc.returncode == 0, describe(proc)
    assert f"prompt optimization with openai:test-model at {url}" in proc.stdout
    assert "SIMULATED" not in proc.stdout
    _check_table(proc.stdout)
    ckpt = _check_learned(out)
    # The same path, but its updates asked for with structured outputs (an HTTP model
    # takes them): other words in those requests, so other token counts.
    _assert_same_run(
        ckpt,
        local_run,
        config=frozenset({"model", "base_url", "latency_ms"}),
        history=frozenset({"tokens"}),
    )
    assert ckpt["job"]["config"]["model"] == "openai:test-model"
    assert any("response_format" in r.body for r in requests)
    assert ckpt["job"]["config"]["base_url"] == url and ckpt["job"]["config"]["latency_ms"] is None
    assert len(requests) > 100
    assert {r.body["model"] for r in requests} == {"test-model"}
    assert {r.headers.get("authorization") or r.headers.get("Authorization") for r in requests} == {
        "Bearer test-key"
    }


@pytest.mark.slow
def test_demo_resume_with_other_settings_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_cli(
        "demo", "--no-progress", "--latency-ms", "1", "--epochs", "1", "--out", str(out)
    )
    assert first.returncode == 0, describe(first)
    again = run_cli(
        "demo", "--no-progress", "--latency-ms", "1", "--epochs", "2", "--out", str(out), "--resume"
    )
    assert again.returncode == 2, describe(again)
    assert "belongs to a different job: epochs is 1 there but 2 now" in again.stderr
    assert "Traceback" not in again.stderr
    slower = run_cli(
        "demo", "--no-progress", "--latency-ms", "2", "--epochs", "1", "--out", str(out), "--resume"
    )
    assert slower.returncode == 2, describe(slower)
    assert "config['latency_ms'] is 1.0 there but 2.0 now" in slower.stderr


# --- Ctrl-C, kill -9, and errors -----------------------------------------------------------


def _wait_for_step(
    out: Path, step: int, proc: subprocess.Popen[str], timeout_s: float = 90
) -> None:
    """Until ``out/checkpoint.json`` records ``step`` completed steps (or more)."""
    deadline = time.monotonic() + timeout_s
    path = out / "checkpoint.json"
    while True:
        if path.exists() and read_json(path)["step"] >= step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the demo exited ({proc.returncode}) before step {step}")
        if time.monotonic() > deadline:
            pytest.fail(f"the demo did not complete step {step} within {timeout_s} s")
        time.sleep(0.02)


@contextmanager
def _demo_process(*args: str, logs: Path) -> Iterator[subprocess.Popen[str]]:
    """``asyncgraph demo --no-progress ARGS`` running, output to ``logs``; killed if still alive."""
    with (logs / "stdout").open("w") as out, (logs / "stderr").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", "demo", "--no-progress", *args], cwd=REPO,
            env=cli_env(), stdout=out, stderr=err, text=True,
        )  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_ctrl_c_of_the_demo_keeps_its_checkpoint_and_resume_finishes_it(
    tmp_path: Path, local_run: dict[str, Any]
) -> None:
    out = tmp_path / "out"
    # 60 ms a call: a step takes several hundred ms, so the SIGINT sent once step 1 is
    # checkpointed lands in the middle of the run, not after its end.
    args = ("--latency-ms", "60", "--out", str(out))
    with _demo_process(*args, logs=tmp_path) as proc:
        _wait_for_step(out, 1, proc)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert code == 130, f"{code}\n{stdout}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert (
        "interrupted: the last completed step is checkpointed; resume with the same command "
        "plus --resume" in stdout
    )
    ckpt = read_json(out / "checkpoint.json")
    done = ckpt["step"]
    assert 1 <= done < 6 and f"steps: {done} " in stdout
    assert read_json(out / "history.json") == {"history": ckpt["history"]}

    resumed = run_cli("demo", "--no-progress", *args, "--resume")
    assert resumed.returncode == 0, describe(resumed)
    assert "steps: 6 " in resumed.stdout
    # What was spent differs: the interrupted step's calls were paid (cut ones counted at
    # their upper bound) and the rows after the resume count on from them (#33.5).
    spent = frozenset({"tokens", "cost_usd", "cut_calls"})
    _assert_same_run(
        _check_learned(out), local_run, config=frozenset({"latency_ms"}), history=spent
    )


def _process(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a live process, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
    return (state, int(ppid), int(session)) if state not in ("Z", "X") else None


def _descendants(pid: int) -> dict[int, str]:
    """The live descendants of ``pid``: pid -> command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        info = _process(int(entry.name))
        if info is not None:
            children.setdefault(info[1], []).append(int(entry.name))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (
                    Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
            except OSError:
                continue
            todo.append(child)
    return found


def test_kill_9_of_the_demo_takes_its_fleet_down(tmp_path: Path, redis_server_binary: None) -> None:
    queue = f"ag-demo-kill-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    args = ("--workers", "2", "--queue", queue, "--latency-ms", "50", "--out", str(out))
    with _demo_process(*args, logs=tmp_path) as proc:
        _wait_for_step(out, 1, proc)
        fleet = _descendants(proc.pid)
        own_session = os.getsid(proc.pid)
        # pid -> session of the demo's own children (redis-server, the worker supervisor)
        direct = {pid: info[2] for pid in fleet if (info := _process(pid)) and info[1] == proc.pid}
        proc.kill()  # SIGKILL: no cleanup code of the demo runs
        proc.wait(10)
    commands = " | ".join(fleet.values())
    from asyncgraph.distributed._redis_server import find_redis_server

    server = Path(find_redis_server()).name  # redis-server, or valkey-server
    assert server in commands and "asyncgraph worker --queue" in commands, fleet
    assert len(direct) == 2, fleet  # the server and the worker supervisor
    for pid, session in direct.items():  # own sessions: a terminal's Ctrl-C does not reach them
        assert session == pid != own_session, (pid, fleet[pid])
    deadline = time.monotonic() + 30
    while (
        left := [pid for pid in fleet if _process(pid) is not None]
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, {pid: fleet[pid] for pid in left}


def test_ctrl_c_while_the_fleet_starts_stops_it_cleanly(
    tmp_path: Path, redis_server_binary: None
) -> None:
    queue = f"ag-demo-start-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    with _demo_process(
        "--workers", "2", "--queue", queue, "--out", str(out), logs=tmp_path
    ) as proc:
        deadline = time.monotonic() + 60
        while not (fleet := _descendants(proc.pid)) or not any(queue in c for c in fleet.values()):
            assert proc.poll() is None and time.monotonic() < deadline, "the fleet did not start"
            time.sleep(0.02)
        # The supervisor is starting its workers: the demo waits for them to announce themselves.
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    stderr = (tmp_path / "stderr").read_text()
    assert code == 130, f"{code}\n{(tmp_path / 'stdout').read_text()}\n{stderr}"
    assert "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 30
    while (
        left := [pid for pid in fleet if _process(pid) is not None]
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, {pid: fleet[pid] for pid in left}


def _demo_main(*args: str) -> int:
    from asyncgraph.cli import main

    try:
        return main(["demo", *args])
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
        (["--latency-ms", "-5"], "argument --latency-ms: must be a finite number >= 0"),
        (["--workers", "-1"], "argument --workers: must be >= 0, got -1"),
        (["--resume"], "error: --resume needs --out DIR"),
        (
            ["--workers", "2", "--redis", "redis://127.0.0.1:6379/0"],
            "argument --redis: not allowed with argument --workers",
        ),
        (["--base-url", "http://127.0.0.1:9/v1"], "error: --base-url is for a real model"),
        (["--model", "gpt-4o"], "names no provider: write 'openai:gpt-4o'"),
        (["--model", "simulated:x"], "the simulated latency must be a number of seconds"),
        (["--model", "openai/gpt-4o", "--base-url", "ftp://x"], "is not an http:// or https://"),
        (["--out", "x", "--resume", "--overwrite"], "not allowed with argument"),
        (["--redis", "redis://127.0.0.1:6379/0", "--queue", "a/b"], "error: queue name must be"),
    ],
    ids=[
        "epochs-0",
        "negative-latency",
        "negative-workers",
        "resume-without-out",
        "workers-and-redis",
        "base-url-with-simulated-model",
        "model-without-provider-gets-the-librarys-suggestion",
        "bad-simulated-latency",
        "provider-slash-form-reaches-the-model",
        "resume-and-overwrite",
        "bad-queue",
    ],
)
def test_demo_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert _demo_main(*args) == 2
    captured = capsys.readouterr()
    assert words in captured.err, captured.err
    assert "Traceback" not in captured.err and "asyncgraph demo: prompt" not in captured.out
    # One line: what was wrong (argparse's usage block is not printed before it).
    assert captured.err.count("\n") == 1 and "usage:" not in captured.err, captured.err


@pytest.mark.parametrize("spec", ["simulated", "simulated:0", "Simulated"])
def test_demo_takes_the_librarys_simulated_spec_for_its_simulated_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str
) -> None:
    """``simulated`` is the spec the models how-to documents: the demo runs its own
    scripted simulated model for it (``simulated:LATENCY_S`` sets the latency)."""
    out = tmp_path / "out"
    args = ["--no-progress", "--epochs", "1", "--latency-ms", "0", "--model", spec]
    assert _demo_main(*args, "--out", str(out)) == 0
    captured = capsys.readouterr()
    assert "Model: SIMULATED (offline" in captured.out, captured.out
    assert read_json(out / "checkpoint.json")["step"] == 3


def test_demo_with_another_jobs_out_says_so_before_its_banner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _demo_main("--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)) == 0
    capsys.readouterr()
    # Another job's checkpoint (2 epochs is another job: its identity differs).
    assert _demo_main("--no-progress", "--epochs", "2", "--out", str(out), "--resume") == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert "error:" in captured.err and "Traceback" not in captured.err


def test_resuming_a_finished_demo_on_workers_starts_no_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished run resumed with --workers says so at once: no redis-server, no worker
    is started for nothing (here none could be: PATH holds no server)."""
    out = tmp_path / "out"
    assert _demo_main("--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)) == 0
    capsys.readouterr()
    monkeypatch.setenv("ASYNCGRAPH_REDIS_SERVER", "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    args = ["--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)]
    assert _demo_main(*args, "--workers", "2", "--resume") == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("already finished (3 step(s)); nothing to do"), captured
    assert "no redis-server found" not in captured.err


def test_demo_refuses_to_overwrite_a_checkpoint_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.json").write_text("{}")
    assert _demo_main("--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out)) == 2
    assert "holds the checkpoint of an earlier run" in capsys.readouterr().err
    assert (out / "checkpoint.json").read_text() == "{}"
    assert (
        _demo_main(
            "--no-progress", "--latency-ms", "0", "--epochs", "1", "--out", str(out), "--overwrite"
        )
        == 0
    )
    assert read_json(out / "checkpoint.json")["step"] == 3


def test_demo_on_a_redis_without_workers_fails_fast(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _demo_main("--redis", redis_url, "--queue", "nobody-serves-this") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no worker of queue 'nobody-serves-this' is alive")
    assert "--import asyncgraph.text --import asyncgraph.jobs.demo" in err


def test_demo_workers_without_a_redis_server_is_one_line_saying_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No server: the one binary allowed is a command that an empty PATH does not have.
    monkeypatch.setenv("ASYNCGRAPH_REDIS_SERVER", "redis-server")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _demo_main("--workers", "1", "--no-progress") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no redis-server found: ") and err.count("\n") == 1, err
    # From this clone the hint that works: an editable install of its fleet extra.
    for hint in (f"pip install -e '{REPO}[fleet]'", "redis-server on PATH", "--redis URL"):
        assert hint in err, err


def test_the_demo_redacts_the_best_system_prompt_it_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prompt the optimizer wrote with a key in it (echoed from a model's error, say) is
    # masked like every other printed line (as `asyncgraph run`'s print_best does).
    import argparse

    from asyncgraph.jobs import JobResult
    from asyncgraph.jobs._demo_cli import _summary

    key = "sk-proj-4f9Qa8ZkT2mX7cV1bN3dR6hJw0"
    result = JobResult(
        history=[],
        parameters=[f"Answer with {key}"],
        initial_val_score=0.5,
        final_val_score=0.75,
        steps_done=1,
        interrupted=False,
        out_dir=tmp_path,
        best_val_score=0.75,
        best_step=1,
        best_parameters=[f"Answer with {key} and at http://u:pw@h/v1"],
    )
    _summary(argparse.Namespace(out=None), result)
    out = capsys.readouterr().out
    assert "best system prompt: Answer with" in out, out
    assert key not in out and "4f9Qa8ZkT2mX" not in out and ":pw@" not in out, out
