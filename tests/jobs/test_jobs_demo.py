"""``asyncgraph demo`` end to end in a subprocess: in-process, on 2 local workers
(embedded redis-server), on the workers of an existing Redis, and against an
OpenAI-compatible endpoint.

The distributed runs must give the same final prompt, optimizer state and metrics
as the in-process run. Compared: the checkpoint's parameters, optimizer state,
step/position and initial validation score, and every history row without
``step_s`` (wall clock), ``tokens`` and ``cost_usd``: the job's process meters
only the model calls it makes itself, and on workers the backward's feedback
calls are made (and metered) in the worker processes, so the distributed run
legitimately reports fewer tokens for the same work.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncgraph.jobs._demo import INITIAL_PROMPT, INSTRUCTIONS, demo_responder
from asyncgraph.jobs._demo_cli import WORKER_IMPORTS
from asyncgraph.jobs._fleet import local_fleet
from asyncgraph.models._testing import OpenAITestServer, Reply

from .jobs_helpers import PNG_MAGIC, TIMING_FIELDS, cli_env, describe, read_json, run_cli, without

NOT_COMPARABLE = TIMING_FIELDS | {"tokens", "cost_usd"}
ACCURACY_ROW = re.compile(r"validation accuracy.*?│\s*0%\s*│\s*100%\s*│")


def _check_table(stdout: str) -> None:
    assert "asyncgraph demo: before / after" in stdout
    assert ACCURACY_ROW.search(stdout), stdout
    assert "system prompt" in stdout and "You are a helpful" in stdout
    assert "steps: 6" in stdout


def _check_learned(out: Path) -> dict[str, Any]:
    ckpt: dict[str, Any] = read_json(out / "checkpoint.json")
    (prompt,) = ckpt["parameters"]
    assert prompt["data"].startswith(INITIAL_PROMPT)
    for instruction in INSTRUCTIONS.values():
        assert instruction in prompt["data"]
    assert ckpt["initial_val_score"] == 0.0 and ckpt["history"][-1]["val_score"] == 1.0
    assert read_json(out / "history.json") == {"history": ckpt["history"]}
    assert (out / "metrics.png").read_bytes().startswith(PNG_MAGIC)
    return ckpt


def _assert_same_run(ckpt: Mapping[str, Any], local: Mapping[str, Any]) -> None:
    for key in ("step", "epoch", "position", "job", "initial_val_score", "parameters", "optimizer"):
        assert ckpt[key] == local[key], key
    assert without(ckpt["history"], NOT_COMPARABLE) == without(local["history"], NOT_COMPARABLE)


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
    return _check_learned(out)


def test_demo_without_arguments(tmp_path: Path) -> None:
    # Exactly what a user types: simulated model at 100 ms a call, progress, a temp dir.
    proc = run_cli("demo", timeout_s=120)
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert "Model: SIMULATED (offline, scripted replies, not a language model; 100 ms per call)" in out
    assert "executor: in-process" in out
    progress = [line for line in out.splitlines() if line.startswith("demo-prompt-optimization: step ")]
    assert len(progress) == 6 and "tokens" in progress[-1] and "acc 1.00" in progress[-1]
    _check_table(out)
    assert "(pass --out DIR to keep them)" in out
    assert "Traceback" not in proc.stderr


def test_demo_local_run_learns_every_instruction(local_run: dict[str, Any]) -> None:
    history = local_run["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["epoch"] for h in history] == [0, 0, 0, 1, 1, 1]
    assert all(h["val_score"] is not None for h in history)
    assert history[0]["train_score"] < history[-1]["train_score"] == 1.0
    assert 0 < history[0]["tokens"] < history[-1]["tokens"]


def test_demo_on_two_local_workers_matches_the_local_run(
    tmp_path: Path, local_run: dict[str, Any]
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
    assert "(the backward's calls ran on the workers)" in proc.stdout
    ckpt = _check_learned(out)
    _assert_same_run(ckpt, local_run)
    # Fewer calls were metered here: the feedback requests ran in the workers.
    assert 0 < ckpt["history"][-1]["tokens"] < local_run["history"][-1]["tokens"]
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
    _assert_same_run(ckpt, local_run)
    assert len(requests) > 100
    assert {r.body["model"] for r in requests} == {"test-model"}
    assert {r.headers.get("authorization") or r.headers.get("Authorization") for r in requests} == {
        "Bearer test-key"
    }


def test_demo_resume_with_other_settings_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_cli("demo", "--no-progress", "--latency-ms", "1", "--epochs", "1", "--out", str(out))
    assert first.returncode == 0, describe(first)
    again = run_cli(
        "demo", "--no-progress", "--latency-ms", "1", "--epochs", "2", "--out", str(out), "--resume"
    )
    assert again.returncode == 2, describe(again)
    assert "belongs to a different job: epochs is 1 there but 2 now" in again.stderr
    assert "Traceback" not in again.stderr
