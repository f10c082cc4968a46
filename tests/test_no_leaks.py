"""Nothing leaks (issue #28, point 2): runs that use every kind of credential print, log,
write and trace none of them.

The credentials: a Redis password in the URL's userinfo, another in its query
(``?password=``), a model endpoint whose base URL holds a password and an ``?api-key=``,
and an API key that the model server echoes in its replies and in its error bodies.
The runs: ``asyncgraph worker --log-level DEBUG`` (its connections dropped once, so it logs its
reconnect warnings), ``asyncgraph demo --redis URL`` and ``asyncgraph run JOB --redis URL`` on that
worker with ``--trace`` and ``--log-calls``, ``asyncgraph status`` (text and ``--json``, a wrong password, a ``unix://`` URL with
its password in the query),
demos whose model fails with an error body, or with a reply, quoting the key, and an
in-process pass traced by OpenTelemetry into memory with the log records captured.
Every line printed, every file under the run directories, every log record and every
span attribute, event and status is searched for every secret.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph.distributed import RedisServer
from asyncgraph.jobs._demo_cli import WORKER_IMPORTS
from asyncgraph.jobs.demo import demo_responder
from asyncgraph.models._testing import OpenAITestServer, Reply

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

USERINFO_PASSWORD = "userinfo-pw-3kq9Zt"
QUERY_PASSWORD = "query-pw-8Hd2Lm"
WRONG_PASSWORD = "wrong-pw-5Vb7Qx"
UNIX_PASSWORD = "unix-pw-7Jc1Ns"
URL_PASSWORD = "endpoint-pw-2Rt6Yc"
URL_KEY = "endpoint-key-9Wn4Pe"
API_KEY = "sk-leaktest-0123456789abcdef"
SECRETS = (
    USERINFO_PASSWORD,
    QUERY_PASSWORD,
    WRONG_PASSWORD,
    UNIX_PASSWORD,
    URL_PASSWORD,
    URL_KEY,
    API_KEY,
)
ECHO = f"(server note: key {API_KEY}, endpoint password {URL_PASSWORD}, api-key {URL_KEY})"


JOB_FILE = """
import os

from asyncgraph.jobs.demo import build_demo_job


def build_job():
    model, base_url = "openai:test-model", os.environ["LEAK_TEST_BASE_URL"]
    return build_demo_job(model, base_url=base_url, epochs=1)[0]
"""


class ModelServer:
    """The demo's scripted answers over HTTP, each feedback quoting every model secret;
    ``mode`` switches to error bodies (``"reject"``) or tagless improvements that quote
    the key (``"unparsable"``)."""

    def __init__(self) -> None:
        self.mode = "answer"
        self.server = OpenAITestServer(handler=self.answer)

    def answer(self, body: Any) -> Reply:
        messages = body["messages"]
        if self.mode == "reject":
            return Reply(status=401, error=f"Incorrect API key provided: {API_KEY}. {ECHO}")
        text = demo_responder(messages)
        # An update asked for, with the tags or as JSON (structured outputs, #34).
        update = "IMPROVED_VARIABLE" in text or text.lstrip().startswith("{")
        if update and self.mode == "unparsable":
            return Reply(text=f"I will not improve it; your key is {API_KEY}. {ECHO}")
        if text.startswith("Add the instruction") or text == "No change needed.":
            text = f"{text}\n{ECHO}"
        return Reply(text=text)

    def base_url(self) -> str:
        host = self.server.url.split("//", 1)[1]
        return f"http://azure-user:{URL_PASSWORD}@{host}?api-version=2024-10-21&api-key={URL_KEY}"


class Outputs:
    """Everything the runs showed: named texts, searched at the end."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def add(self, name: str, text: str) -> None:
        self.texts[name] = self.texts.get(name, "") + text

    def add_process(self, name: str, proc: subprocess.CompletedProcess[str]) -> None:
        self.add(f"{name} stdout", proc.stdout)
        self.add(f"{name} stderr", proc.stderr)

    def add_files(self, root: Path) -> None:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            self.add(f"file {path.relative_to(root)}", path.read_bytes().decode("utf-8", "replace"))

    def leaks(self) -> list[str]:
        return [
            f"{secret!r} in {name}: ...{text[max(0, i - 200) : i + 60]}..."
            for name, text in self.texts.items()
            for secret in SECRETS
            if (i := text.find(secret)) >= 0
        ]


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCGRAPH_", "OPENAI_"))}
    return env | {"PYTHONUNBUFFERED": "1", "OPENAI_API_KEY": API_KEY} | extra


def run_cli(
    *args: str, env: Mapping[str, str], timeout_s: float = 180.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncgraph", *args],
        cwd=REPO,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


@pytest.fixture
def redis_with_passwords(redis_server_binary: None) -> Iterator[tuple[str, str, int]]:
    """A redis-server whose default user needs one password and a second user another:
    the URL with the password in its userinfo, the URL with it in its query, the port."""
    import redis

    with RedisServer() as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        admin.acl_setuser(
            "leaktester",
            enabled=True,
            passwords=[f"+{QUERY_PASSWORD}"],
            commands=["+@all"],
            keys=["*"],
            channels=["*"],
        )
        admin.config_set("requirepass", USERINFO_PASSWORD)
        admin.close()
        yield (
            f"redis://default:{USERINFO_PASSWORD}@127.0.0.1:{server.port}/0",
            f"redis://leaktester@127.0.0.1:{server.port}/0?password={QUERY_PASSWORD}",
            server.port,
        )


def drop_connections(port: int) -> None:
    import redis

    admin = redis.Redis(host="127.0.0.1", port=port, password=USERINFO_PASSWORD)
    admin.client_kill_filter(_type="normal", skipme=True)
    admin.close()


def start_worker(url: str, queue: str, base_url: str, log: Path) -> subprocess.Popen[str]:
    env = cli_env(ASYNCGRAPH_ALLOWED_BASE_URLS=base_url)
    imports = [arg for module in WORKER_IMPORTS for arg in ("--import", module)]
    command = ["worker", "--log-level", "DEBUG", "--redis", url, "--queue", queue, *imports]
    with log.open("w") as sink:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "asyncgraph", *command],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )


def stop_worker(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def wait_for_line(log: Path, text: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text("utf-8", "replace"):
            return True
        time.sleep(0.1)
    return False


def test_no_output_of_runs_with_credentials_holds_any_of_them(
    tmp_path: Path, redis_with_passwords: tuple[str, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the in-process pass's models read it
    userinfo_url, query_url, port = redis_with_passwords
    queue = f"leaks-{uuid.uuid4().hex[:8]}"
    outputs = Outputs()
    model = ModelServer()
    with model.server:
        base_url = model.base_url()
        worker_log = tmp_path / "worker.log"
        worker = start_worker(query_url, queue, base_url, worker_log)
        try:
            assert wait_for_line(worker_log, "serving"), worker_log.read_text()
            out = tmp_path / "demo-remote"
            demo = run_cli(
                "demo", "--redis", userinfo_url, "--queue", queue, "--model",
                "openai:test-model", "--base-url", base_url, "--epochs", "1", "--no-progress",
                "-v", "--out", str(out), "--trace", "--log-calls", str(out / "calls.jsonl"),
                env=cli_env(),
            )  # fmt: skip
            outputs.add_process("demo --redis (userinfo password)", demo)
            assert demo.returncode == 0, describe(demo)
            assert "executor: workers of redis://default:***@" in demo.stdout
            assert (out / "calls.jsonl").stat().st_size > 0 and list(out.glob("traces/*.json"))
            assert "[redacted]" in (out / "calls.jsonl").read_text()  # the echoes were there

            job_file = tmp_path / "leak_job.py"
            job_file.write_text(JOB_FILE)
            ran_out = tmp_path / "run-remote"
            ran = run_cli(
                "run", str(job_file), "--redis", query_url, "--queue", queue, "--no-progress",
                "-v", "--out", str(ran_out), "--trace", "--log-calls", str(ran_out / "calls.jsonl"),
                env=cli_env(LEAK_TEST_BASE_URL=base_url),
            )  # fmt: skip
            outputs.add_process("run --redis (query password)", ran)
            assert ran.returncode == 0, describe(ran)
            assert (ran_out / "calls.jsonl").stat().st_size > 0

            drop_connections(port)  # the worker reconnects, saying so
            assert wait_for_line(worker_log, "WARNING"), worker_log.read_text()
            for url, name in ((userinfo_url, "userinfo"), (query_url, "query")):
                for extra in ([], ["--json"]):
                    status = run_cli(
                        "status", "--redis", url, "--queue", queue, *extra, env=cli_env()
                    )
                    outputs.add_process(f"status {extra} ({name} password)", status)
                    assert status.returncode == 0, describe(status)
                    assert "***" in status.stdout
            wrong = userinfo_url.replace(USERINFO_PASSWORD, WRONG_PASSWORD)
            refused = run_cli("status", "--redis", wrong, "--queue", queue, env=cli_env())
            outputs.add_process("status (wrong password)", refused)
            assert refused.returncode != 0 and "error" in refused.stderr.lower()
            socket = f"unix://{tmp_path}/no-such.sock?db=0&password={UNIX_PASSWORD}"
            unreachable = run_cli("status", "--redis", socket, "--queue", queue, env=cli_env())
            outputs.add_process("status (unix socket, query password)", unreachable)
            assert unreachable.returncode != 0 and "password=***" in unreachable.stderr, describe(
                unreachable
            )
            traced = anyio.run(traced_pass, userinfo_url, queue, base_url, model)
            for name, text in traced.items():
                outputs.add(name, text)
        finally:
            stop_worker(worker)
        outputs.add("worker -v log", worker_log.read_text("utf-8", "replace"))

        for mode in ("reject", "unparsable"):
            model.mode = mode
            failed_out = tmp_path / f"demo-{mode}"
            failed = run_cli(
                "demo", "--model", "openai:test-model", "--base-url", base_url, "--epochs",
                "1", "--no-progress", "--max-attempts", "2", "-v", "--out", str(failed_out),
                "--log-calls", str(failed_out / "calls.jsonl"), env=cli_env(),
            )  # fmt: skip
            outputs.add_process(f"demo with a model that {mode}s", failed)
            if mode == "reject":
                assert failed.returncode == 1, describe(failed)
                assert "error: " in failed.stderr and "[redacted]" in failed.stderr, describe(
                    failed
                )
            else:  # an update that cannot be read is skipped, not the job's end (#34)
                assert failed.returncode == 0, describe(failed)
                history = json.loads((failed_out / "history.json").read_text())["history"]
                assert any(row.get("skipped_updates") for row in history), history
    outputs.add_files(tmp_path)
    assert outputs.texts and not outputs.leaks(), "\n".join(outputs.leaks())


async def traced_pass(
    redis_url: str, queue: str, base_url: str, model: ModelServer
) -> dict[str, str]:
    """A pass traced by OpenTelemetry into memory, with the log records captured: one
    remote node on the worker, and local model calls answered, then refused, by the
    server echoing the key. Returns the span texts and the log lines, by name."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from asyncgraph import BackwardError, Parameter, use_executor
    from asyncgraph.distributed import open_redis_executor
    from asyncgraph.models import OpenAIChat, Retry
    from asyncgraph.observe.otel import otel_tracing
    from asyncgraph.text import LLMCall, TextLoss

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handler = Collect()
    records = handler.records
    root = logging.getLogger()  # every logger's records: asyncgraph's, httpx's, ...
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    # httpx's own level as a fresh process has it (importing LiteLLM, in an earlier test
    # of the same run, sets it to WARNING for the whole process).
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.NOTSET)
    local = OpenAIChat(
        "test-model", base_url=base_url, api_key=API_KEY, retry=Retry(max_attempts=2)
    )
    try:
        with otel_tracing(provider, capture_content=True):
            async with open_redis_executor(redis_url, queue=queue) as executor:
                with use_executor(executor):
                    spec = "openai:test-model"
                    prompt = Parameter("Answer briefly.", role="system prompt")
                    question = "What is 2 + 2?"
                    answer = await LLMCall.apply(prompt, question, model=spec, base_url=base_url)
                    judge = TextLoss("Is the answer brief?", model=spec, base_url=base_url)
                    loss = await judge(answer)
                    await loss.backward()
            # A server error quoting the key, retried (and logged), then an answer.
            model.server.script(Reply(status=500, error=f"upstream rejected {API_KEY}. {ECHO}"))
            await local.complete([{"role": "user", "content": f"say {API_KEY}"}])
            model.mode = "reject"
            try:
                with pytest.raises(BackwardError):
                    from asyncgraph import Function, Variable

                    class Ask(Function):
                        @staticmethod
                        def forward(ctx: Any, x: Variable) -> Variable:
                            return Variable(x.data, role="asked")

                        @staticmethod
                        async def backward(ctx: Any, grad: Variable) -> str:
                            return (await local.complete([{"role": "user", "content": "hi"}])).text

                    await Ask.apply(Parameter("x", role="x")).backward()
            finally:
                model.mode = "answer"
        await local.aclose()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        httpx_logger.setLevel(httpx_level)
    spans = exporter.get_finished_spans()
    calls = [s for s in spans if s.name.startswith("chat ")]
    host, port = base_url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
    assert calls and {(s.attributes or {}).get("server.address") for s in calls} == {host}
    assert {(s.attributes or {}).get("server.port") for s in calls} == {int(port)}
    assert any(s.status.description and "[redacted]" in s.status.description for s in spans)
    span_text = "\n".join(
        json.dumps(
            {
                "name": s.name,
                "attributes": {k: str(v) for k, v in (s.attributes or {}).items()},
                "status": s.status.description,
                "events": [
                    (e.name, {k: str(v) for k, v in (e.attributes or {}).items()}) for e in s.events
                ],
            }
        )
        for s in spans
    )
    log_text = "\n".join(
        f"{r.levelname} {r.name}: {r.getMessage()} {_exc_text(r.exc_info)}" for r in records
    )
    assert "attempt 1 failed" in log_text and "HTTP Request: POST" in log_text, log_text
    return {"OTel spans": span_text, "log records": log_text}


class Collect(logging.Handler):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _exc_text(exc_info: Any) -> str:
    if not exc_info or exc_info[1] is None:
        return ""
    import traceback

    return "".join(traceback.format_exception(exc_info[1]))
