"""``asyncgraph ui``: the run dashboard's data, its local server, and the page in Chromium."""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph.cli import main
from asyncgraph.jobs import JobResult, run_job
from asyncgraph.jobs._ui import (
    find_runs,
    load_run,
    open_ui_server,
    run_labels,
    run_summary,
    word_diff,
)
from asyncgraph.jobs.demo import build_demo_job, demo_responder
from asyncgraph.models import Pricing, SimulatedModel
from asyncgraph.text import register_model, unregister_model

from .jobs_helpers import PNG_MAGIC, REPO, cli_env, describe, run_cli

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


JOB = "demo-prompt-optimization"
# The runs' directories under one root, and the labels the dashboard gives them: two share
# their last component, so they are told apart by the one before.
RUN_DIRS = ("one/demo", "two/demo", "three-epochs")
LABELS = ("one/demo", "two/demo", "three-epochs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three real demo runs of the same job (1, 2 and 3 epochs), traced, with a call log."""
    root = tmp_path_factory.mktemp("runs")
    made = []
    for epochs, name in enumerate(RUN_DIRS, start=1):
        out = root / name
        out.mkdir(parents=True)
        proc = run_cli(
            "demo", "--no-progress", "--latency-ms", "1", "--epochs", str(epochs),
            "--out", str(out), "--trace", "--log-calls", str(out / "calls.jsonl"),
        )  # fmt: skip
        assert proc.returncode == 0, describe(proc)
        made.append(out)
    return made


PRICED = "priced-ui-demo"


@pytest.fixture(scope="module")
def capped_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real demo runs on a priced simulated model: ``free`` without a cap; ``capped``
    stopped at the step boundary before step 3 by its cap; ``raised``, a copy of it
    resumed with a higher cap to the end; ``replayed``, a copy of ``free`` whose last
    history row counts two calls replayed from the journal (a worker's crash is what makes
    them: the fleet's tests do that; here the dashboard only has to show the count)."""
    root = tmp_path_factory.mktemp("capped")
    register_model(
        PRICED,
        SimulatedModel(
            latency_s=0.001, responder=demo_responder, tag_replies=False,
            pricing=Pricing(15.0, 60.0),
        ),
    )  # fmt: skip

    async def run(out: Path, cap: float | None, *, resume: bool = False) -> JobResult:
        job, _ = build_demo_job(PRICED, epochs=1)
        job.max_cost_usd = cap
        return await run_job(job, out, progress=False, resume=resume)

    try:
        free = anyio.run(run, root / "free", None)
        costs = [row["cost_usd"] for row in free.history]
        capped = anyio.run(run, root / "capped", (costs[1] + costs[2]) / 2)
        assert capped.stopped_at_cost_cap and capped.steps_done == 2
        shutil.copytree(root / "capped", root / "raised")
        raised = anyio.run(functools.partial(run, root / "raised", 1.0, resume=True))
        assert not raised.stopped_at_cost_cap and raised.steps_done == 3
    finally:
        unregister_model(PRICED)
    shutil.copytree(root / "free", root / "replayed")
    checkpoint = json.loads((root / "replayed" / "checkpoint.json").read_text())
    # As a run whose worker died after two model calls returned: the rerun replayed them.
    checkpoint["history"][-1]["replayed_calls"] = checkpoint["spent"]["replayed_calls"] = 2
    (root / "replayed" / "checkpoint.json").write_text(json.dumps(checkpoint))
    return {name: root / name for name in ("free", "capped", "raised", "replayed")}


def at(url: str, path: str) -> str:
    """``path`` on the dashboard served at ``url`` (the URL it prints, with its token)."""
    base, _, token = url.partition("?")
    return f"{base}{path}{'&' if '?' in path else '?'}{token}"


def get(url: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_word_diff_marks_inserted_and_deleted_words() -> None:
    assert word_diff("Be brief.", "Be brief. Show units.") == [
        ["=", "Be brief."],
        ["+", " Show units."],
    ]
    assert word_diff("a b c", "a x c") == [["=", "a "], ["-", "b"], ["+", "x"], ["=", " c"]]
    assert word_diff("same", "same") == [["=", "same"]]
    assert word_diff("", "new") == [["+", "new"]]
    diff = word_diff("one two three", "three two one")
    assert "".join(t for op, t in diff if op != "-") == "three two one"
    assert "".join(t for op, t in diff if op != "+") == "one two three"


@pytest.mark.slow
def test_load_run_has_metrics_parameters_with_diffs_feedback_and_traces(runs: list[Path]) -> None:
    run = load_run(runs[1])
    assert run["name"] == JOB
    assert run["label"] == "demo"  # alone, a run is labelled by its directory's name
    assert load_run(runs[1], label="two/demo")["label"] == "two/demo"
    assert run["steps_done"] == 6 and run["total_steps"] == 6
    assert [h["step"] for h in run["history"]] == [1, 2, 3, 4, 5, 6]
    assert run["initial_val_score"] == 0.0
    (prompt,) = run["parameters"]
    assert prompt["role"] == "system prompt of the question answerer"
    assert prompt["name"] == "system_prompt"  # its name in the demo's Module
    assert [s["step"] for s in prompt["steps"]] == [0, 1, 2, 3, 4, 5, 6]
    first, second = prompt["steps"][:2]
    assert first["diff"] is None and first["value"] == "You are a helpful assistant."
    assert second["changed"] and ["+", " Reverse words letter by letter."] in second["diff"]
    assert len(second["feedback"]) == 8
    assert run["traces"] == [f"step-{s:04d}.json" for s in range(7)]
    assert run["call_log"] == str((runs[1] / "calls.jsonl").resolve())


def test_runs_are_labelled_by_the_shortest_trailing_path_that_tells_them_apart() -> None:
    assert run_labels(["/r/baseline", "/r/tuned"]) == ["baseline", "tuned"]
    assert run_labels(["/a/x/out", "/b/x/out", "/c/other"]) == ["a/x/out", "b/x/out", "other"]
    assert run_labels(["/x/out", "/y/x/out"]) == ["/x/out", "y/x/out"]
    assert run_labels(["out", "/abs/out"]) == ["out", "abs/out"]
    assert run_labels(["/r/same", "/r/same", "/r/same"]) == ["/r/same", "/r/same #2", "/r/same #3"]
    assert run_labels([]) == []


def test_a_run_without_a_checkpoint_is_named_by_its_directory(tmp_path: Path) -> None:
    summary = run_summary(tmp_path / "starting")
    assert summary["label"] == summary["name"] == "starting"
    assert summary["steps_done"] == 0 and summary["total_steps"] is None
    assert run_summary(tmp_path / "starting", label="b/starting")["label"] == "b/starting"


def test_a_step_redone_after_an_interrupt_shows_its_last_line(tmp_path: Path) -> None:
    lines = [
        {"step": 0, "parameters": [{"role": "p", "value": "a"}]},
        {"step": 1, "parameters": [{"role": "p", "value": "a b"}], "feedback": []},
        {"step": 1, "parameters": [{"role": "p", "value": "a c"}], "feedback": []},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 2, "param'
    (tmp_path / "steps.jsonl").write_text(text)
    run = load_run(tmp_path)
    assert [s["value"] for s in run["parameters"][0]["steps"]] == ["a", "a c"]
    assert run["history"] == [] and run["steps_done"] == 0
    # Recorded before the cap and the stop lines were kept: nothing to say of them.
    assert (run["max_cost_usd"], run["cost_usd"], run["forward_on"]) == (None, None, None)
    assert (run["stopped"], run["stopped_at_cost_cap"], run["replayed_calls"]) == (None, False, 0)


def test_the_newest_run_line_says_the_cap_and_whether_the_run_stopped(tmp_path: Path) -> None:
    lines = [
        {"step": 0, "max_cost_usd": 0.5, "forward_on": "in-process"},
        {"step": 1, "max_cost_usd": 0.5, "forward_on": "in-process"},
        {"event": "stop", "at_step": 1, "reason": "cost_cap", "max_cost_usd": 0.5},
    ]
    history = [{"step": 1, "cost_usd": 0.4, "replayed_calls": 2}]
    (tmp_path / "checkpoint.json").write_text(json.dumps({"history": history}))

    def summary() -> dict[str, Any]:
        (tmp_path / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return run_summary(tmp_path)

    first = summary()
    assert (first["max_cost_usd"], first["cost_usd"], first["replayed_calls"]) == (0.5, 0.4, 2)
    assert first["stopped"] == "cost_cap" and first["stopped_at_cost_cap"]
    # Resumed with a higher cap, on the workers: running again, the newest cap holds.
    lines.append({"event": "resume", "at_step": 1, "max_cost_usd": 2, "forward_on": "workers"})
    resumed = summary()
    assert (resumed["max_cost_usd"], resumed["forward_on"]) == (2, "workers")
    assert resumed["stopped"] is None and not resumed["stopped_at_cost_cap"]
    lines.append({"event": "stop", "at_step": 1, "reason": "interrupted", "max_cost_usd": 2})
    assert summary()["stopped"] == "interrupted" and not summary()["stopped_at_cost_cap"]


@pytest.mark.slow
def test_the_api_serves_runs_steps_calls_and_traces_to_the_loopback_only(
    runs: list[Path],
) -> None:
    with open_ui_server(runs) as url:
        status, body = get(at(url, "api/runs"))
        assert status == 200
        summaries = json.loads(body)["runs"]
        assert [r["steps_done"] for r in summaries] == [3, 6, 9]
        assert [(r["label"], r["name"]) for r in summaries] == [(label, JOB) for label in LABELS]
        assert [json.loads(get(at(url, f"api/run/{i}"))[1])["label"] for i in range(3)] == list(
            LABELS
        )
        status, body = get(at(url, "api/run/0/calls/2"))
        calls = json.loads(body)["calls"]
        assert status == 200 and calls
        assert {c["labels"]["step"] for c in calls} == {2}
        assert {c["labels"]["phase"] for c in calls} == {
            "forward",
            "backward",
            "optimizer step",
            "validation",
        }
        status, body = get(at(url, "api/run/1/trace/4"))
        assert status == 200 and json.loads(body)["traceEvents"]
        assert get(at(url, "api/run/1/trace/99"))[0] == 404
        assert get(at(url, "api/run/3"))[0] == 404
        assert get(at(url, "api/run/0/../../etc/passwd"))[0] == 404
        status, page = get(url)
        assert status == 200 and b'<script src="/app.js"' in page
        assert get(at(url, "app.js"))[0] == 200 and get(at(url, "app.css"))[0] == 200
        # A page elsewhere that resolves its own name to 127.0.0.1 gets nothing.
        assert get(at(url, "api/runs"), host="attacker.example:80")[0] == 403


@pytest.mark.slow
def test_the_api_says_the_cap_the_spend_the_stop_at_the_cap_and_replayed_calls(
    capped_runs: dict[str, Path],
) -> None:
    with open_ui_server(list(capped_runs.values())) as url:
        runs = {r["label"]: r for r in json.loads(get(at(url, "api/runs"))[1])["runs"]}
        assert json.loads(get(at(url, "api/run/1"))[1])["stopped_at_cost_cap"] is True
    free, capped, raised, replayed = (runs[name] for name in capped_runs)
    history = json.loads((capped_runs["free"] / "checkpoint.json").read_text())["history"]
    costs = [row["cost_usd"] for row in history]
    assert free["max_cost_usd"] is None and not free["stopped_at_cost_cap"]
    assert free["cost_usd"] == costs[-1] > 0 and free["replayed_calls"] == 0
    # Stopped by its cap before step 3: what it spent by step 2, under the cap.
    assert capped["max_cost_usd"] == pytest.approx((costs[1] + costs[2]) / 2)
    assert capped["stopped"] == "cost_cap" and capped["stopped_at_cost_cap"]
    assert capped["cost_usd"] == pytest.approx(costs[1]) and capped["steps_done"] == 2
    # Resumed with a higher cap: the newest cap, and no longer stopped.
    assert raised["max_cost_usd"] == 1.0 and raised["stopped"] is None
    assert raised["cost_usd"] == pytest.approx(costs[-1]) and raised["steps_done"] == 3
    assert replayed["replayed_calls"] == 2
    events = [
        {k: line[k] for k in ("event", "at_step", "max_cost_usd")} | {"reason": line.get("reason")}
        for line in map(
            json.loads, (capped_runs["raised"] / "steps.jsonl").read_text().splitlines()
        )
        if "event" in line
    ]
    assert events == [
        {
            "event": "stop",
            "at_step": 2,
            "max_cost_usd": capped["max_cost_usd"],
            "reason": "cost_cap",
        },
        {"event": "resume", "at_step": 2, "max_cost_usd": 1.0, "reason": None},
    ]


def test_an_absurd_run_or_step_number_is_a_400_not_a_traceback(tmp_path: Path) -> None:
    with open_ui_server([tmp_path]) as url:
        for path in (
            f"api/run/0/calls/{'9' * 5000}",
            f"api/run/0/trace/{'1' * 10}",
            f"api/run/{'7' * 5000}",
        ):
            status, body = get(at(url, path))
            assert status == 400 and body == b"run or step number out of range", path
        assert get(at(url, "api/run/0/calls/123456789"))[0] == 200  # nine digits: fine


@pytest.mark.slow
def test_the_ui_follows_a_run_while_it_runs(tmp_path: Path) -> None:
    out = tmp_path / "live"
    out.mkdir()
    log = tmp_path / "demo.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", "demo", "--no-progress", "--latency-ms", "40",
             "--out", str(out), "--overwrite"],
            env=cli_env(), stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
        try:
            with open_ui_server([out]) as url:
                seen: list[int] = []
                deadline = time.monotonic() + 60
                while proc.poll() is None and time.monotonic() < deadline:
                    seen.append(json.loads(get(at(url, "api/run/0"))[1])["steps_done"])
                    time.sleep(0.1)
                final = json.loads(get(at(url, "api/run/0"))[1])
            assert proc.wait(timeout=60) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    running = sorted(set(seen))
    assert len([s for s in running if 0 < s < 6]) >= 2, running  # several steps seen live
    assert final["steps_done"] == 6


@pytest.mark.slow
def test_ui_of_a_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("ui", str(tmp_path / "nope"), "--no-browser")
    assert proc.returncode == 2
    assert "error: not a directory" in proc.stderr and "--out directories" in proc.stderr


# -- which folders are runs (a folder of runs), and the port --------------------------------


def step_lines(run: Path, steps: int) -> Path:
    """A run folder whose steps.jsonl recorded steps 0 to ``steps`` (a prompt per step)."""
    run.mkdir(parents=True)
    lines = [
        {"step": s, "parameters": [{"role": "prompt", "value": f"prompt {s}"}]}
        for s in range(steps + 1)
    ]
    (run / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_a_folder_of_runs_stands_for_the_runs_one_or_two_levels_below_it(tmp_path: Path) -> None:
    # The issue: `asyncgraph ui runs` (11 run folders) showed one empty run named "runs".
    root = tmp_path / "runs"
    for n in range(1, 12):
        step_lines(root / f"r{n}", 2)
    step_lines(root / "sweep" / "seed10", 1)  # two levels down, under a folder of runs
    step_lines(root / "sweep" / "seed9", 1)
    (root / "old").mkdir()
    (root / "old" / "history.json").write_text(json.dumps({"history": []}))  # older runs
    (root / "ckpt").mkdir()
    (root / "ckpt" / "checkpoint.json").write_text("{}")
    step_lines(root / ".hidden", 1)  # hidden folders are not looked in
    step_lines(root / "deep" / "a" / "b", 1)  # three levels down: not a run of root's
    (root / "notes").mkdir()
    (root / "README.txt").write_text("not a folder")
    names = [str(p.relative_to(root)) for p in find_runs(root)]
    assert names == [
        "ckpt", "old", *(f"r{n}" for n in range(1, 12)), "sweep/seed9", "sweep/seed10"
    ]  # fmt: skip
    # A run folder stands for itself (its traces/ and other folders are not runs).
    (root / "r3" / "traces").mkdir()
    assert find_runs(root / "r3") == [root / "r3"]
    assert find_runs(root / "sweep") == [root / "sweep" / "seed9", root / "sweep" / "seed10"]
    assert find_runs(root / "deep") == [root / "deep" / "a" / "b"]
    assert find_runs(root / "notes") == []
    with open_ui_server(find_runs(root)) as url:
        runs = json.loads(get(at(url, "api/runs"))[1])["runs"]
    assert [r["label"] for r in runs] == [Path(n).name for n in names]
    assert [r["steps_done"] for r in runs][:2] == [0, 0]


def test_a_folder_with_no_run_is_one_line_saying_what_a_run_folder_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes" / "drafts").mkdir(parents=True)
    (tmp_path / "notes" / "todo.txt").write_text("runs go elsewhere")
    step_lines(tmp_path / "good", 1)
    monkeypatch.chdir(tmp_path)
    assert main(["ui", "good", "notes", "--no-browser", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("error: no run in notes: a run folder is the --out directory of ")
    assert "holds steps.jsonl, checkpoint.json or history.json" in err
    # The page of the command quotes it as it is.
    assert err.strip() in (REPO / "docs" / "cli" / "ui.md").read_text()


def test_a_port_out_of_range_or_in_use_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The issue: `asyncgraph ui --port 99999` printed bind()'s OverflowError traceback.
    run = step_lines(tmp_path / "run", 1)
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as exited:
            main(["ui", str(run), "--no-browser", "--port", port])
        assert exited.value.code == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"argument --port: {port!r} is not a port: give 0 to 65535" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["ui", str(run), "--no-browser", "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: port {port} on 127.0.0.1 is in use; pick another --port (0: any free one)\n"
    )


def _ctrl_c(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C to ``asyncgraph ui`` and its stderr once it has exited; killed (and the
    test failed) if it has not within a minute, so that no process or pipe outlives it."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


@pytest.mark.slow
def test_the_ui_command_serves_the_runs_of_a_folder_of_runs(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for n in (1, 2, 10, 11):
        step_lines(root / f"r{n}", n)
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgraph", "ui", str(root), "--no-browser", "--port", "0"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", line)
        assert url and "(4 run(s); Ctrl-C stops)" in line, line
        runs = json.loads(get(at(url[0], "api/runs"))[1])["runs"]
        assert [r["label"] for r in runs] == ["r1", "r2", "r10", "r11"]
        steps = [json.loads(get(at(url[0], f"api/run/{i}"))[1])["recorded_steps"] for i in range(4)]
        assert steps == [list(range(n + 1)) for n in (1, 2, 10, 11)]
    finally:
        err = _ctrl_c(proc)
    assert proc.returncode == 0, err


# -- runs of different lengths ----------------------------------------------------------


def test_each_run_says_which_steps_it_recorded(tmp_path: Path) -> None:
    # The issue: runs of 4, 4, 4 and 6 steps all opened at step 6.
    short, long = step_lines(tmp_path / "r1", 4), step_lines(tmp_path / "demo", 6)
    history = [{"step": s, "train_loss": 1.0} for s in range(1, 8)]  # a step 7 ending
    (long / "checkpoint.json").write_text(json.dumps({"history": history}))
    with open_ui_server([short, long]) as url:
        runs = [json.loads(get(at(url, f"api/run/{i}"))[1]) for i in range(2)]
    assert runs[0]["recorded_steps"] == [0, 1, 2, 3, 4]
    assert runs[1]["recorded_steps"] == [0, 1, 2, 3, 4, 5, 6, 7]  # steps.jsonl's and history's


# -- who may read the runs, and which files -----------------------------------------------


def fetch(
    url: str, *, cookie: str | None = None, raw_path: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A GET with http.client (sends ``raw_path`` as written: no normalizing of ``..``)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    path = (
        raw_path if raw_path is not None else parts.path + (f"?{parts.query}" * bool(parts.query))
    )
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    response = conn.getresponse()
    body = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return response.status, headers, body


def traced_run(root: Path, name: str = "run") -> Path:
    """A run directory as a job writes it: a step with its trace and call log inside."""
    run = root / name
    (run / "traces").mkdir(parents=True)
    log = run / "calls.jsonl"
    (run / "steps.jsonl").write_text(
        json.dumps({"step": 1, "trace": "traces/step-0001.json", "call_log": str(log)}) + "\n"
    )
    (run / "traces" / "step-0001.json").write_text(json.dumps({"traceEvents": []}))
    log.write_text(json.dumps({"model": "m", "labels": {"step": 1}, "prompt": "mine"}) + "\n")
    return run


PAGES = ("", "index.html", "app.js", "app.css", "api/runs", "api/run/0", "api/run/0/calls/1",
         "api/run/0/trace/1")  # fmt: skip


def test_every_request_needs_the_token_then_its_cookie(tmp_path: Path) -> None:
    # The issue: as `nobody`, /api/run/0, /calls/1 and /trace/1 returned the user's data.
    run = traced_run(tmp_path)
    with open_ui_server([run]) as url:
        base, _, query = url.partition("?")
        token = query.removeprefix("token=")
        assert len(token) >= 32 and urllib.parse.urlsplit(url).path == "/"
        port = urllib.parse.urlsplit(url).port
        wrong = "x" * len(token)
        for page in PAGES:
            status, headers, body = fetch(base + page)
            assert status == 403 and b"no valid token" in body, page
            assert b"mine" not in body and "set-cookie" not in headers
            assert fetch(f"{base}{page}?token={wrong}")[0] == 403
            assert fetch(f"{base}{page}?token={token[:-1]}")[0] == 403
            assert fetch(base + page, cookie=f"asyncgraph-ui-{port}={wrong}")[0] == 403
            # Another dashboard's cookie (browsers share cookies across ports) is not ours.
            assert fetch(base + page, cookie=f"asyncgraph-ui-{port + 1}={token}")[0] == 403
            status, headers, body = fetch(f"{base}{page}?token={token}")
            assert status == 200, (page, body)
            cookie = headers["set-cookie"]
            assert cookie.startswith(f"asyncgraph-ui-{port}={token};"), cookie
            assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= {
                part.strip() for part in cookie.split(";")
            }
            assert headers["referrer-policy"] == "no-referrer"
            status, headers, again = fetch(base + page, cookie=f"asyncgraph-ui-{port}={token}")
            assert status == 200 and again == body and "set-cookie" not in headers, page
        assert b"mine" in fetch(f"{base}api/run/0/calls/1?token={token}")[2]
        # A malformed cookie header is no cookie, not an error.
        assert fetch(base, cookie='asyncgraph-ui-1="unterminated')[0] == 403
    with open_ui_server([run], token="a-token-of-my-own_1") as url:
        assert url.endswith("/?token=a-token-of-my-own_1")
        assert get(at(url, "api/runs"))[0] == 200
    for bad in ("", "short", "spaces are not ok here", "semi;colon-0123456789"):
        with pytest.raises(ValueError, match="16 or more letters"):
            with open_ui_server([run], token=bad):
                pass


def test_only_regular_files_inside_the_run_folders_are_served(tmp_path: Path) -> None:
    run, other = traced_run(tmp_path), traced_run(tmp_path, "other")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    secret = outside / "secret.json"
    secret.write_text(json.dumps({"traceEvents": [{"name": "SECRET"}], "job": {"name": "SECRET"}}))
    foreign_log = outside / "calls.jsonl"  # another project's call log
    foreign_log.write_text(json.dumps({"labels": {"step": 2}, "prompt": "SECRET"}) + "\n")
    traces = run / "traces"
    (traces / "step-0002.json").symlink_to(secret)  # the symlink
    (traces / "step-0003.json").symlink_to(run / "traces" / "step-0001.json")  # inside: fine
    os.mkfifo(traces / "step-0004.json")  # would block a reader forever
    (traces / "step-0005.json").symlink_to(traces / "step-0005.json")  # a loop
    (traces / "step-0006.json").symlink_to(traces / "step-0002.json")  # a link to the link
    lines = [
        {"step": 1, "trace": "traces/step-0001.json", "call_log": str(run / "calls.jsonl")},
        {"step": 2, "call_log": str(foreign_log)},
    ]
    (run / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / "checkpoint.json").symlink_to(secret)
    # A run whose call log lies in another run folder shown: both runs' data, served.
    shared = [{"step": 1, "call_log": str(run / "calls.jsonl")}]
    (other / "steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in shared))
    # A run folder whose traces directory is a link to outside.
    linked = tmp_path / "linked"
    linked.mkdir()
    (outside / "traces").mkdir()
    (outside / "traces" / "step-0001.json").write_text('{"SECRET": 1}')
    (linked / "traces").symlink_to(outside / "traces")
    (linked / "steps.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with open_ui_server([run, other, linked]) as url:
        assert get(at(url, "api/run/0/trace/1"))[0] == 200
        assert get(at(url, "api/run/0/trace/3"))[0] == 200  # a link inside the run folder
        for step in (2, 6):
            status, body = get(at(url, f"api/run/0/trace/{step}"))
            assert status == 403 and b"SECRET" not in body, step
            assert b"outside the run directories given to asyncgraph ui" in body
        status, body = get(at(url, "api/run/0/trace/4"))
        assert status == 403 and b"not a regular file" in body
        assert get(at(url, "api/run/0/trace/5"))[0] == 404  # a loop: no such trace
        status, body = get(at(url, "api/run/0/calls/2"))
        assert status == 403 and b"SECRET" not in body and str(foreign_log).encode() in body
        status, body = get(at(url, "api/run/0"))
        assert status == 200 and b"SECRET" not in body  # the checkpoint link is not read
        assert json.loads(body)["name"] == "run"
        status, body = get(at(url, "api/run/1/calls/1"))
        assert status == 200 and json.loads(body)["calls"][0]["prompt"] == "mine"
        status, body = get(at(url, "api/run/2/trace/1"))
        assert status == 403 and b"SECRET" not in body
        token = url.partition("?")[2]
        for raw in (
            "/api/run/0/../../elsewhere/secret.json",
            "/%2e%2e/%2e%2e/elsewhere/secret.json",
            "/api/run/0/trace/1/../../../../elsewhere/secret.json",
            "/../elsewhere/secret.json",
        ):
            status, _, body = fetch(url, raw_path=f"{raw}?{token}")
            assert status == 404 and b"SECRET" not in body, raw


@pytest.mark.slow
def test_the_ui_command_prints_its_token_and_opens_the_browser_on_a_private_file(
    tmp_path: Path,
) -> None:
    run = traced_run(tmp_path)
    record = tmp_path / "browser.txt"
    recorder = tmp_path / "browser.py"
    recorder.write_text(
        "import os, sys\n"
        "target = sys.argv[1]\n"
        "path = target.removeprefix('file://')\n"
        "mode = oct(os.stat(path).st_mode & 0o777)\n"
        f"open({str(record)!r}, 'w').write(repr(sys.argv) + '\\n' + mode + '\\n' + open(path).read())\n"
    )
    token = "my-own-token-from-the-environment"
    env = {**cli_env(), "BROWSER": f"{sys.executable} {recorder} %s", "ASYNCGRAPH_UI_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncgraph", "ui", str(run), "--port", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", line)
        assert url and url[0].endswith(f"?token={token}"), line
        deadline = time.monotonic() + 60
        while not (record.exists() and record.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "no browser opened"
            time.sleep(0.05)
        argv, mode, page = record.read_text().split("\n", 2)
        assert token not in argv and "file://" in argv  # not on a command line (ps)
        assert mode == "0o600" and url[0] in page
        assert get(at(url[0], "api/run/0"))[0] == 200
        assert get(url[0].partition("?")[0] + "api/run/0")[0] == 403
    finally:
        err = _ctrl_c(proc)
    assert proc.returncode == 0, err
    redirect = re.search(r"'file://([^']+)'", argv)
    assert redirect and not Path(redirect[1]).exists()  # removed when the server stops
    short = run_cli("ui", str(run), "--no-browser", "--token", "short")
    assert short.returncode == 2 and "16 or more letters" in short.stderr
    assert "Traceback" not in short.stderr


# -- the page, in a real headless Chromium ----------------------------------------------


def find_chromium() -> str | None:
    explicit = os.environ.get("ASYNCGRAPH_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
def chromium() -> Iterator[list[str]]:
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no Chromium to load the dashboard in: install Debian's `chromium` package "
            "(.ci/run does, as root: apt-get install chromium) or set ASYNCGRAPH_CHROMIUM"
        )
    with tempfile.TemporaryDirectory(prefix="asyncgraph-chromium-") as profile:
        yield [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]


def browse(command: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command, "--virtual-time-budget=15000", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def columns(dom: str) -> list[tuple[int, str]]:
    """Each run's column in the page: the step it shows and its HTML."""
    parts = re.split(r'(?=<div class="column" data-run="\d+")', dom)[1:]
    shown = [re.match(r'<div class="column" data-run="\d+" data-step="(\d+)"', p) for p in parts]
    assert all(shown), [p[:200] for p in parts]
    return [(int(m[1]), p) for m, p in zip(shown, parts, strict=True) if m]


@pytest.mark.slow
def test_the_dashboard_renders_charts_diffs_feedback_timeline_and_calls_in_chromium(
    runs: list[Path], chromium: list[str], tmp_path: Path
) -> None:
    with open_ui_server(runs) as url:
        page = f"{url}&step=2"
        done = browse(chromium, "--dump-dom", page)
        assert done.returncode == 0, done.stderr[-2000:]
        dom = done.stdout
        assert 'data-ready="1"' in dom and 'data-step="2"' in dom, dom[-3000:]
        # Five charts, one line per run in each, the longer run with a point per step.
        charts = re.findall(r'<svg class="chart" data-metric="([a-z_]+)"', dom)
        assert charts == ["train_loss", "train_score", "val_score", "tokens", "cost_usd"]
        lines = re.findall(r'<path class="series" data-run="(\d)" d="([^"]+)"', dom)
        assert sorted({run for run, _ in lines}) == ["0", "1", "2"] and len(lines) == 15
        loss_of_run_1 = lines[1][1]
        assert loss_of_run_1.count("L") == 5  # 6 steps
        # Three runs side by side, each with the prompt's word diff at step 2 and its feedback.
        assert count(r'<div class="column" data-run="\d" data-step="2">', dom) == 3
        assert count(r"<ins>[^<]+</ins>", dom) >= 3
        assert "<ins> Multiply digit by digit and double-check the product.</ins>" in dom
        assert count(r"feedback received in step 2: 8 entries", dom) == 3
        assert count(r"<li>Add the instruction: ", dom) >= 8
        # The step's timeline (nodes and model calls) and its model calls.
        assert count(r'<rect class="span node', dom) >= 3 * 16
        assert count(r'<rect class="span model', dom) >= 3 * 60
        assert count(r'<rect class="span phase', dom) == 3 * 4
        assert count(r'<tr class="call">', dom) >= 3 * 60
        # A screenshot of the same page (the README's picture of the dashboard).
        shot = tmp_path / "ui.png"
        done = browse(
            chromium, "--hide-scrollbars", "--window-size=1400,2000", f"--screenshot={shot}", page
        )
        assert done.returncode == 0, done.stderr[-2000:]
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 50_000
    keep = os.environ.get("ASYNCGRAPH_UI_SCREENSHOT")
    if keep:
        Path(keep).write_bytes(data)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1400, 1000])
def test_three_runs_fit_the_window_labelled_by_directory_with_readable_timelines(
    runs: list[Path], chromium: list[str], width: int
) -> None:
    with open_ui_server(runs) as url:
        done = browse(chromium, f"--window-size={width},1600", "--dump-dom", f"{url}&step=2")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body and 'data-ready="1"' in body[1], dom[-3000:]
    # The page's own check after rendering: nothing wider than its card, its chart or the
    # window (tables, replies, labels), and no chart or timeline text under 10.5 px.
    assert 'data-overflow=""' in body[1], body[1]
    assert 'data-small-text=""' in body[1], body[1]
    # Each run by its directory (two named "demo" told apart by their parent), the job's
    # name beside it: in its chip, the five chart legends and its column's heading.
    for label in LABELS:
        named = f'<span class="label">{label}</span><span class="job">{JOB}</span>'
        assert count(re.escape(named), dom) == 1 + 5 + 1, label
    # The timeline: each model call is drawn under the node bar that made it, never over
    # one; bars are labelled by their Function or model, whole or elided with "…" (its
    # last words, or its start); a bar too short for three letters has no label.
    nodes, calls = timeline_bars(dom, "node"), timeline_bars(dom, "model")
    assert len(nodes) >= 3 * 16 and len(calls) >= 3 * 60
    assert not [(c, n) for c in calls for n in nodes if overlap(c, n)]
    labels = re.findall(r'<text class="label[^"]*"[^>]*>([^<]+)</text>', dom)
    assert "validation" in labels, labels  # the longest phase is always wide enough
    known = ("DemoJudge", "DemoAnswer", "forward", "backward", "optimizer step", "validation")
    assert [t for t in labels if not labelled(t, (*known, "simulated"))] == []


def timeline_bars(dom: str, kind: str) -> list[tuple[float, float, float, float]]:
    """The x, y, width and height of the timeline's bars of ``kind`` (node, model)."""
    pattern = (
        rf'<rect class="span {kind}[^"]*" x="([\d.]+)" y="([\d.]+)"'
        r' width="([\d.]+)" height="([\d.]+)"'
    )
    return [(float(x), float(y), float(w), float(h)) for x, y, w, h in re.findall(pattern, dom)]


def overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    (ax, ay, aw, ah), (bx, by, bw, bh) = a, b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def labelled(text: str, names: tuple[str, ...]) -> bool:
    """``text`` is one of ``names``, or one elided with "…" and three characters kept."""
    return any(
        text == name
        or (len(text) >= 4 and text.endswith("…") and name.startswith(text[:-1]))
        or (len(text) >= 4 and text.startswith("…") and name.endswith(text[1:]))
        for name in names
    )


@pytest.mark.slow
def test_the_timeline_names_node_bars_by_function_and_the_calls_under_them_by_model(
    tmp_path: Path, chromium: list[str]
) -> None:
    # A hand-written trace of one step: a long node whose model call runs inside it, a
    # short node after it, in one lane under the phases.
    run = tmp_path / "traced"
    (run / "traces").mkdir(parents=True)
    trace_file = "traces/step-0001.json"
    (run / "steps.jsonl").write_text(json.dumps({"step": 1, "trace": trace_file}) + "\n")
    thread = {"ph": "M", "pid": 1, "name": "thread_name"}
    span = {"ph": "X", "pid": 1, "tid": 1}
    events = [
        {**thread, "tid": 0, "args": {"name": "phases"}},
        {**thread, "tid": 1, "args": {"name": "lane 1"}},
        {"ph": "X", "pid": 1, "tid": 0, "cat": "phase", "name": "backward", "ts": 0, "dur": 1e6},
        {**span, "cat": "node", "name": "FormattedLLMCall", "ts": 0, "dur": 6e5},
        {**span, "cat": "model", "name": "model gpt-4o-mini", "ts": 1e4, "dur": 5e5,
         "args": {"model": "gpt-4o-mini", "prompt_tokens": 10}},
        {**span, "cat": "node", "name": "DemoJudgeOfAnswers", "ts": 6.2e5, "dur": 8e4},
    ]  # fmt: skip
    (run / trace_file).write_text(json.dumps({"traceEvents": events}))
    with open_ui_server([run]) as url:
        done = browse(chromium, "--window-size=1000,1000", "--dump-dom", f"{url}&step=1")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-overflow=""' in dom and 'data-small-text=""' in dom, dom[-3000:]
    (long_node, _), (call,) = timeline_bars(dom, "node"), timeline_bars(dom, "model")
    assert call[1] >= long_node[1] + long_node[3]  # below the node, not over it
    assert long_node[0] <= call[0] and call[0] + call[2] <= long_node[0] + long_node[2]
    labels = re.findall(r'<text class="(label[^"]*)"[^>]*>([^<]+)</text>', dom)
    assert ("label", "backward") in labels and ("label", "FormattedLLMCall") in labels
    assert ("label call", "gpt-4o-mini") in labels  # the model, not "model gpt-4o-mi"
    # The short node (about 70 px): its last words, not a prefix every Demo node shares.
    assert ("label", "…Answers") in labels or ("label", "…OfAnswers") in labels, labels
    assert "DemoJudgeOfAnswers (80.0 ms)" in dom  # its full name in the bar's tooltip


@pytest.mark.slow
def test_the_run_chips_show_the_spend_against_the_cap_the_stop_and_replayed_calls(
    capped_runs: dict[str, Path], chromium: list[str]
) -> None:
    with open_ui_server(list(capped_runs.values())) as url:
        done = browse(chromium, "--window-size=1000,1200", "--dump-dom", url)
        runs = json.loads(get(at(url, "api/runs"))[1])["runs"]
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    body = re.search(r"<body([^>]*)>", dom)
    assert body and 'data-ready="1"' in body[1], dom[-3000:]
    assert 'data-overflow=""' in body[1], body[1]
    run_list = re.search(r'<div id="runs"[^>]*>(.*?)</div>', dom)
    assert run_list, dom[:3000]
    chips = run_list[1].split('<span class="run-chip"')[1:]
    assert [re.search(r'data-run="(\d)"', chip)[1] for chip in chips] == ["0", "1", "2", "3"]
    free, capped, raised, replayed = chips
    capped_run = runs[1]
    spent, cap = money(capped_run["cost_usd"]), money(capped_run["max_cost_usd"])
    assert f'<span class="spent">spent {spent} of the {cap} cap</span>' in capped
    assert '<span class="live capped">stopped at the cost cap</span>' in capped
    assert "of the $1.00 cap</span>" in raised and "stopped" not in raised
    assert "spent" not in free and "replayed" not in free  # no cap, no replayed call
    assert ">2 model calls replayed from the journal</span>" in replayed


def money(value: float) -> str:
    """Dollars as the page writes them (app.js ``money``; for amounts from $0.001 to $1e15)."""
    if value == 0:
        return "$0"
    return f"${value:.2f}" if value >= 1 else f"${float(f'{value:.3g}')}"


@pytest.mark.slow
def test_runs_of_different_lengths_each_show_their_own_latest_step(
    runs: list[Path], chromium: list[str]
) -> None:
    # The issue: runs of 4 and 6 steps opened at step 6, the 4-step runs showing "no trace
    # for step 6" and "no model calls logged in step 6" beside their prompt at step 4.
    with open_ui_server(runs) as url:
        latest = browse(chromium, "--window-size=1400,2000", "--dump-dom", url)
        chosen = browse(chromium, "--window-size=1400,2000", "--dump-dom", f"{url}&step=5")
    for done in (latest, chosen):
        assert done.returncode == 0, done.stderr[-2000:]
        body = re.search(r"<body([^>]*)>", done.stdout)
        assert body and 'data-ready="1"' in body[1] and 'data-overflow=""' in body[1], body
    # Following the latest step (the default): each run its own, 3, 6 and 9.
    shown = columns(latest.stdout)
    assert [step for step, _ in shown] == [3, 6, 9]
    for (step, html), ends in zip(shown, (3, 6, 9), strict=True):
        assert f"value after step {step}" in html and "latest recorded" not in html
        assert f"timeline of step {step}" in html and f"model calls of step {step}" in html
        assert "no trace for step" not in html and "no model calls logged" not in html
        assert count(r'<tr class="call">', html) >= 60  # the step's calls, loaded
        note = f"no step 9 in this run (steps 0 to {ends}): showing step {ends}, its latest"
        assert (note in html) == (ends < 9), html[:2000]
    # The picker says which steps each run has, and which steps only some runs have.
    assert (
        '<span id="step-runs" class="step-runs" aria-label="steps of each run">one/demo: '
        "steps 0 to 3 · two/demo: steps 0 to 6 · three-epochs: steps 0 to 9</span>"
    ) in latest.stdout
    options = re.findall(r"<option[^>]*>([^<]*)</option>", latest.stdout)
    assert options[:5] == ["0 (start)", "1", "2", "3", "4 (2 of 3 runs)"]
    assert options[-1] == "9 (1 of 3 runs)"
    # Step 5 chosen: the runs that have it show it, the 3-step run its last step, in every
    # card of its column.
    shown = columns(chosen.stdout)
    assert [step for step, _ in shown] == [3, 5, 5]
    assert "no step 5 in this run (steps 0 to 3): showing step 3, its latest" in shown[0][1]
    assert "timeline of step 3" in shown[0][1] and "model calls of step 3" in shown[0][1]
    assert "step-note" not in shown[1][1] + shown[2][1]


@pytest.mark.slow
def test_a_run_that_has_not_ended_a_step_shows_no_chart_axes_it_cannot_know(
    tmp_path: Path, chromium: list[str]
) -> None:
    # The issue: an empty run's token chart had an axis labelled 1, 1, 0.
    run = step_lines(tmp_path / "starting", 0)
    with open_ui_server([run]) as url:
        done = browse(chromium, "--window-size=1000,1200", "--dump-dom", url)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-ready="1"' in dom and 'data-overflow=""' in dom, dom[-3000:]
    assert '<svg class="chart"' not in dom
    assert re.findall(r'<p class="empty no-data" data-metric="(\w+)">nothing recorded yet</p>', dom) == [
        "train_loss", "train_score", "val_score", "tokens", "cost_usd"
    ]  # fmt: skip
    assert "value after step 0" in dom
