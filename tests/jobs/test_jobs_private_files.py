"""One redaction and one private mode for every file of a run (#33 point 4).

A job whose ``config`` holds a base URL with a password and an ``?api-key=``, whose model
is called with an API key, a credential header and a header marked ``Secret``, whose
server echoes every one of them in the forms servers do (upper-cased, without its
prefix, split, cut short), and whose text parameter quotes them as a prompt might: run
with a trace, a call log in the run directory and MLflow on a local store. Every file
and directory it leaves, in the run directory and in MLflow's store, is 0600 / 0700 and
holds none of the secrets in any of those forms; so does what the dashboard serves.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from asyncgraph import Parameter
from asyncgraph._redact import Secret
from asyncgraph.jobs import Evaluation, Job, MLflowReporter, run_job
from asyncgraph.jobs._ui import open_ui_server
from asyncgraph.models import OpenAIChat
from asyncgraph.models._testing import OpenAITestServer, Reply

from .jobs_helpers import LineFit

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")

pytestmark = pytest.mark.anyio

API_KEY = "sk-proj-Zq81hKx0Pw5vLm3NcT7bYd2R"
HEADER_TOKEN = "hdr-tok-9Fk2Lm8Qx4Vz7Pw1"
MARKED = "tenant-pass-Jm4Rq8Zx3"
URL_PASSWORD = "url-pw-4Tg8Hs5"
URL_KEY = "url-key-7Nc3Wd9"
SECRETS = (API_KEY, HEADER_TOKEN, MARKED, URL_PASSWORD, URL_KEY)


def core(secret: str) -> str:
    """The secret without its provider prefix (``sk-proj-``, ``hdr-tok-``)."""
    return secret.split("-", 2)[-1] if secret.count("-") >= 2 else secret


def echoed(secret: str) -> str:
    """The forms a server echoes ``secret`` in."""
    rest = core(secret)
    return (
        f"{secret.upper()} / {secret.lower()} / {rest} / {secret[:9]} {secret[9:]} / "
        f"{rest[:12]}... / ...{rest[-12:]}"
    )


ECHO = "; ".join(f"got {echoed(s)}" for s in SECRETS)


def leaks(text: str) -> list[str]:
    """The secrets ``text`` gives away: any whole one, or 12 characters of the start or
    end of a key without its prefix, in any case, whitespace taken out."""
    flat = "".join(text.split()).lower()
    found = []
    for secret in SECRETS:
        rest = core(secret).lower()
        pieces = (secret.lower(), rest[:12], rest[-12:]) if len(secret) >= 16 else (secret,)
        if any(piece.lower() in flat for piece in pieces):
            found.append(secret)
    return found


def tree(root: Path) -> Iterator[Path]:
    yield root
    yield from root.rglob("*")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    return (tmp_path / "mlruns").as_uri()


@pytest.fixture
def echoing_server() -> Iterator[OpenAITestServer]:
    def answer(body: Any) -> Reply:
        return Reply(text=f"the server says: {ECHO}")

    with OpenAITestServer(handler=answer) as server:
        yield server


def job_with_secrets(server: OpenAITestServer) -> tuple[Job, str]:
    host = server.url.split("://", 1)[1]
    base_url = f"http://user:{URL_PASSWORD}@{host}?api-key={URL_KEY}"
    model = OpenAIChat(
        "test-model",
        base_url=base_url,
        api_key=API_KEY,
        headers={"X-Auth-Token": HEADER_TOKEN, "X-Tenant": Secret(MARKED)},
    )
    fit = LineFit(epochs=1)
    note = Parameter(f"remember {ECHO}", role="note", requires_grad=False)

    async def forward(example: Mapping[str, Any]) -> Evaluation:
        await model.complete([{"role": "user", "content": f"x is {example['x']}"}])
        return await fit.forward(example)

    job = Job(
        name="private-files",
        parameters=[fit.w, note],
        optimizer=fit.optimizer,
        forward=forward,
        train_set=fit.job.train_set,
        val_set=fit.job.val_set,
        batch_size=fit.job.batch_size,
        epochs=1,
        validate_every=2,
        config={
            "base_url": base_url,
            "api_key": "short",  # a credential by its name, however short
            "headers": {"Authorization": f"Bearer {API_KEY}", "X-Trace": "on"},
            "lr": 0.02,
        },
    )
    return job, base_url


async def test_every_file_of_a_run_and_of_its_mlflow_store_is_private_and_redacted(
    tmp_path: Path, store: str, echoing_server: OpenAITestServer
) -> None:
    job, base_url = job_with_secrets(echoing_server)
    run = tmp_path / "run"
    reporter = MLflowReporter(job, tracking_uri=store, experiment="private", progress=False)
    before = os.umask(0)  # the widest umask: every mode below is ours, not the umask's
    try:
        result = await run_job(
            job, run, reporter=reporter, trace=True, log_calls=run / "calls.jsonl"
        )
    finally:
        os.umask(before)
    assert result.steps_done == job.total_steps and reporter.run_id is not None
    assert echoing_server.requests  # the model was called: its replies echoed the secrets

    written = {p.relative_to(tmp_path).as_posix() for p in tree(run) if p.is_file()}
    assert {
        "run/checkpoint.json",
        "run/best.json",
        "run/history.json",
        "run/steps.jsonl",
    } <= written
    assert {"run/metrics.png", "run/calls.jsonl", "run/traces/step-0001.json"} <= written
    mlruns = tmp_path / "mlruns"
    logged = [p.relative_to(mlruns).as_posix() for p in tree(mlruns) if p.is_file()]
    assert any(name.endswith("params/config.base_url") for name in logged)
    assert any(name.endswith("artifacts/best/1-note.txt") for name in logged), logged
    assert any(name.endswith("artifacts/run/calls.jsonl") for name in logged)

    wrong_modes, leaked = [], []
    for path in [*tree(run), *tree(mlruns)]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode != (0o700 if path.is_dir() else 0o600):
            wrong_modes.append(f"{path.relative_to(tmp_path)} {oct(mode)}")
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            leaked += [f"{path.relative_to(tmp_path)}: {s}" for s in leaks(text)]
    assert wrong_modes == []
    assert leaked == []

    # What MLflow keeps of the config: masked where it stands, the rest as it was.
    params = mlflow.tracking.MlflowClient(tracking_uri=store).get_run(reporter.run_id).data.params
    assert params["config.base_url"] == base_url.replace(URL_PASSWORD, "***").replace(
        URL_KEY, "***"
    )
    assert params["config.api_key"] == "***" and params["config.lr"] == "0.02"
    assert json.loads(params["config.headers"]) == {"Authorization": "***", "X-Trace": "on"}
    # The checkpoint's identity is the config as shown: a resume matches it.
    identity = json.loads((run / "checkpoint.json").read_text())["job"]["config"]
    assert identity == json.loads(json.dumps(job.identity()["config"]))
    assert identity["api_key"] == "***"

    # The dashboard serves the run as written: redacted.
    assert await anyio.to_thread.run_sync(dashboard_leaks, run) == []


def dashboard_leaks(run: Path) -> list[str]:
    """The secrets that what ``asyncgraph ui`` serves of ``run`` gives away, by path."""
    found = []
    with open_ui_server([run]) as url:
        base, _, token = url.partition("?")
        for path in ("api/runs", "api/run/0", "api/run/0/calls/1", "api/run/0/trace/1"):
            with urllib.request.urlopen(f"{base}{path}?{token}", timeout=10) as response:
                assert response.status == 200, path
                found += [f"{path}: {s}" for s in leaks(response.read().decode())]
    return found


async def test_a_checkpoint_written_before_configs_were_redacted_still_resumes(
    tmp_path: Path,
) -> None:
    fit = LineFit()
    fit.job.config = {"base_url": "http://u:pw-older@h/v1?api-key=k-older", "lr": 0.02}
    first = await run_job(fit.job, tmp_path / "run", progress=False)
    checkpoint = tmp_path / "run" / "checkpoint.json"
    state = json.loads(checkpoint.read_text())
    assert state["job"]["config"]["base_url"] == "http://u:***@h/v1?api-key=***"
    # As an older version wrote it: the config verbatim, at an earlier step.
    state["job"]["config"] = dict(fit.job.config)
    checkpoint.write_text(json.dumps(state))
    again = LineFit()
    again.job.config = dict(fit.job.config)
    resumed = await run_job(again.job, tmp_path / "run", resume=True, progress=False)
    assert resumed.already_finished and resumed.steps_done == first.steps_done
    # A new password is the same job; another setting is not.
    again.job.config = {**fit.job.config, "base_url": "http://u:rotated@h/v1?api-key=k2"}
    assert (await run_job(again.job, tmp_path / "run", resume=True)).already_finished
