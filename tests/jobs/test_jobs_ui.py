"""``asyncgraph ui``: the run dashboard's data, its local server, and the page in Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph.jobs._ui import load_run, open_ui_server, word_diff

from .jobs_helpers import PNG_MAGIC, cli_env, describe, run_cli

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two real demo runs (1 and 2 epochs), traced and with a call log."""
    made = []
    for epochs in (1, 2):
        out = tmp_path_factory.mktemp(f"demo{epochs}")
        proc = run_cli(
            "demo", "--no-progress", "--latency-ms", "1", "--epochs", str(epochs),
            "--out", str(out), "--trace", "--log-calls", str(out / "calls.jsonl"),
        )  # fmt: skip
        assert proc.returncode == 0, describe(proc)
        made.append(out)
    return made


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
    assert run["name"] == "demo-prompt-optimization"
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


@pytest.mark.slow
def test_the_api_serves_runs_steps_calls_and_traces_to_the_loopback_only(
    runs: list[Path],
) -> None:
    with open_ui_server(runs) as url:
        status, body = get(url + "api/runs")
        assert status == 200
        assert [r["steps_done"] for r in json.loads(body)["runs"]] == [3, 6]
        status, body = get(url + "api/run/0/calls/2")
        calls = json.loads(body)["calls"]
        assert status == 200 and calls
        assert {c["labels"]["step"] for c in calls} == {2}
        assert {c["labels"]["phase"] for c in calls} == {
            "forward",
            "backward",
            "optimizer step",
            "validation",
        }
        status, body = get(url + "api/run/1/trace/4")
        assert status == 200 and json.loads(body)["traceEvents"]
        assert get(url + "api/run/1/trace/99")[0] == 404
        assert get(url + "api/run/7")[0] == 404
        assert get(url + "api/run/0/../../etc/passwd")[0] == 404
        status, page = get(url)
        assert status == 200 and b'<script src="/app.js"' in page
        assert get(url + "app.js")[0] == 200 and get(url + "app.css")[0] == 200
        # A page elsewhere that resolves its own name to 127.0.0.1 gets nothing.
        assert get(url + "api/runs", host="attacker.example:80")[0] == 403


def test_an_absurd_run_or_step_number_is_a_400_not_a_traceback(tmp_path: Path) -> None:
    with open_ui_server([tmp_path]) as url:
        for path in (
            f"api/run/0/calls/{'9' * 5000}",
            f"api/run/0/trace/{'1' * 10}",
            f"api/run/{'7' * 5000}",
        ):
            status, body = get(url + path)
            assert status == 400 and body == b"run or step number out of range", path
        assert get(url + "api/run/0/calls/123456789")[0] == 200  # nine digits: fine


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
                    seen.append(json.loads(get(url + "api/run/0")[1])["steps_done"])
                    time.sleep(0.1)
                final = json.loads(get(url + "api/run/0")[1])
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


@pytest.mark.slow
def test_the_dashboard_renders_charts_diffs_feedback_timeline_and_calls_in_chromium(
    runs: list[Path], chromium: list[str], tmp_path: Path
) -> None:
    with open_ui_server(runs) as url:
        page = f"{url}?step=2"
        done = browse(chromium, "--dump-dom", page)
        assert done.returncode == 0, done.stderr[-2000:]
        dom = done.stdout
        assert 'data-ready="1"' in dom and 'data-step="2"' in dom, dom[-3000:]
        # Five charts, one line per run in each, the longer run with a point per step.
        charts = re.findall(r'<svg class="chart" data-metric="([a-z_]+)"', dom)
        assert charts == ["train_loss", "train_score", "val_score", "tokens", "cost_usd"]
        lines = re.findall(r'<path class="series" data-run="(\d)" d="([^"]+)"', dom)
        assert sorted({run for run, _ in lines}) == ["0", "1"] and len(lines) == 10
        loss_of_run_1 = lines[1][1]
        assert loss_of_run_1.count("L") == 5  # 6 steps
        # Two runs side by side, each with the prompt's word diff at step 2 and its feedback.
        assert count(r'<div class="column" data-run="\d">', dom) == 2
        assert count(r"<ins>[^<]+</ins>", dom) >= 2
        assert "<ins> Multiply digit by digit and double-check the product.</ins>" in dom
        assert count(r"feedback received in step 2: 8 entries", dom) == 2
        assert count(r"<li>Add the instruction: ", dom) >= 8
        # The step's timeline (nodes and model calls) and its model calls.
        assert count(r'<rect class="span node', dom) >= 16
        assert count(r'<rect class="span model', dom) >= 60
        assert count(r'<rect class="span phase', dom) == 8
        assert count(r'<tr class="call">', dom) >= 2 * 60
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
