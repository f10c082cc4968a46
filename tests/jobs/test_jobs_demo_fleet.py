"""``asyncgraph demo --workers N``'s own fleet: it reaches the ``--base-url`` endpoint, and it
is locked (a Redis password and a task-signing secret, random or the user's).

Real processes: the demo, its redis-server and its workers; a real local HTTP server
speaking the chat completions protocol plays the model.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from asyncgraph.jobs._demo_cli import _usage_problem
from asyncgraph.jobs.demo import demo_responder
from asyncgraph.models._testing import OpenAITestServer, Reply

from .jobs_helpers import REPO, cli_env, describe, run_cli

API_KEY = "sk-demo-fleet-key"
USER_SECRET = "the-user-s-own-secret-0123456789"


def _answer(body: Any) -> Reply:
    return Reply(text=demo_responder(body["messages"]))


def test_a_short_secret_of_the_user_is_a_usage_error_before_the_fleet_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncgraph.cli import build_parser

    monkeypatch.setenv("ASYNCGRAPH_SECRET", "too-short")
    args = build_parser("demo").parse_args(["demo", "--workers", "2"])
    problem = _usage_problem(args)
    assert problem is not None and problem.startswith(
        "ASYNCGRAPH_SECRET must be at least 16 bytes long (the demo's workers sign with it)"
    )
    assert _usage_problem(build_parser("demo").parse_args(["demo"])) is None  # no workers: unused


@pytest.mark.slow
def test_the_demo_s_workers_call_the_base_url_it_was_given(
    tmp_path: Path, redis_server_binary: None
) -> None:
    queue = f"ag-demo-fleet-{uuid.uuid4().hex[:8]}"
    with OpenAITestServer(handler=_answer) as server:
        proc = run_cli(
            "demo", "--model", "openai:test-model", "--base-url", server.url, "--workers", "2",
            "--queue", queue, "--no-progress", "--out", str(tmp_path / "out"),
            env=cli_env(OPENAI_API_KEY=API_KEY), timeout_s=240,
        )  # fmt: skip
        requests = server.requests
    assert proc.returncode == 0, describe(proc)
    assert "executor: 2 local worker processes via an embedded redis-server" in proc.stdout
    assert re.search(r"validation accuracy.*?│\s*0%\s*│\s*100%\s*│", proc.stdout), proc.stdout
    assert "steps: 6" in proc.stdout
    # The feedback requests (the backward) are made by the workers only.
    feedback = [r for r in requests if "feedback engine" in str(r.body["messages"][0])]
    assert feedback and len(requests) > 100
    assert {r.headers.get("authorization") for r in requests} == {f"Bearer {API_KEY}"}


def _worker_environment(queue: str) -> dict[str, str] | None:
    """The environment of a running ``asyncgraph worker`` of ``queue``, or None."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            if b"worker" not in args or queue.encode() not in args:
                continue
            raw = (cmdline.parent / "environ").read_bytes()
        except OSError:
            continue
        pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
        return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}
    return None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("user_secret", [None, USER_SECRET], ids=["random", "the user's"])
def test_the_demo_s_fleet_has_a_password_and_a_secret(
    tmp_path: Path, redis_server_binary: None, user_secret: str | None
) -> None:
    queue = f"ag-demo-lock-{uuid.uuid4().hex[:8]}"
    env = cli_env()
    env.pop("ASYNCGRAPH_SECRET", None)
    if user_secret is not None:
        env["ASYNCGRAPH_SECRET"] = user_secret
    command = [
        sys.executable, "-m", "asyncgraph", "demo", "--workers", "2", "--queue", queue,
        "--no-progress", "--latency-ms", "20", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    demo = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker_env = None
    try:
        deadline = time.monotonic() + 60
        while worker_env is None and demo.poll() is None and time.monotonic() < deadline:
            worker_env = _worker_environment(queue)
            time.sleep(0.05)
        stdout, stderr = demo.communicate(timeout=240)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    done = subprocess.CompletedProcess(demo.args, demo.returncode, stdout, stderr)
    assert done.returncode == 0, describe(done)
    assert "steps: 6" in stdout
    assert worker_env is not None, "no worker of the demo was seen running"
    secret = worker_env.get("ASYNCGRAPH_SECRET", "")
    if user_secret is None:
        assert re.fullmatch(r"[0-9a-f]{64}", secret), "the workers have no random secret"
    else:
        assert secret == user_secret
    password = re.fullmatch(
        r"redis://:([0-9a-f]{32})@127\.0\.0\.1:\d+/0", worker_env["ASYNCGRAPH_REDIS_URL"]
    )
    assert password, "the embedded Redis has no password"
    assert password[1] not in stdout + stderr and secret not in stdout + stderr
