"""The model call log: one JSON line per call, with its node and trace; never a secret."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgraph import Parameter
from asyncgraph.models import MemoryCache, OpenAIChat, Pricing, Retry, SimulatedModel
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.observe import labels, log_calls, read_call_log, trace_pass
from asyncgraph.text import concat

from .observe_helpers import Critique

pytestmark = pytest.mark.anyio

ENV_KEY = "sk-envsecret-0123456789abcdef"
HEADER_KEY = "hdr-secret-value-0123456789"


@pytest.fixture
def server() -> Iterator[OpenAITestServer]:
    with OpenAITestServer() as srv:
        yield srv


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_call_is_logged_with_request_reply_tokens_latency_and_no_api_key(
    tmp_path: Path, server: OpenAITestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)
    monkeypatch.setenv("MY_SERVICE_TOKEN", HEADER_KEY)
    model = OpenAIChat(
        "gpt-4o-mini",
        base_url=server.url,
        headers={"x-api-key": HEADER_KEY},
        pricing=Pricing(0.15, 0.60),
    )
    path = tmp_path / "calls.jsonl"
    async with model, log_calls(path) as log:
        with labels(step=3, phase="forward"):
            # The server echoes the message: a key quoted in a prompt comes back in the reply.
            reply = await model.complete(
                [{"role": "user", "content": f"my key is {ENV_KEY}, and Bearer abcdefgh12345678"}],
                temperature=0,
            )
    # The model did see it; the client redacts its own key from the reply (models/_http.py)...
    assert ENV_KEY in server.requests[0].body["messages"][0]["content"]
    assert ENV_KEY not in reply.text
    assert server.requests[0].headers["authorization"] == f"Bearer {ENV_KEY}"
    text = path.read_text()
    assert ENV_KEY not in text and HEADER_KEY not in text  # ... the log does not
    assert "abcdefgh12345678" not in text
    assert "[redacted]" in text
    assert log.count == 1
    (record,) = lines(path)
    request = record["request"]
    assert isinstance(request, dict)
    assert request["url"] == f"{server.url}/chat/completions"
    assert request["body"]["temperature"] == 0  # type: ignore[index]
    assert request["body"]["messages"][0]["content"].startswith("my key is [redacted]")  # type: ignore[index]
    assert "headers" not in request
    assert record["reply"] == reply.text.replace(ENV_KEY, "[redacted]").replace(
        "abcdefgh12345678", "[redacted]"
    )
    assert record["model"] == "gpt-4o-mini"
    assert record["prompt_tokens"] == reply.prompt_tokens > 0
    assert record["completion_tokens"] == reply.completion_tokens > 0
    assert record["cost_usd"] == pytest.approx(
        Pricing(0.15, 0.60).cost_usd(reply.prompt_tokens, reply.completion_tokens)
    )
    assert isinstance(record["latency_s"], float) and record["latency_s"] > 0
    assert record["cached"] is False
    assert record["attempts"] == 1 and record["retries"] == 0
    assert record["node"] is None and record["trace_id"] is None
    assert record["labels"] == {"step": 3, "phase": "forward"}
    assert record["error"] is None and record["finish_reason"] == "stop"


async def test_retries_cache_hits_errors_and_unknown_prices_are_logged(
    tmp_path: Path, server: OpenAITestServer
) -> None:
    model = OpenAIChat(
        "my-local-model",
        base_url=server.url,
        retry=Retry(max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.002),
        cache=MemoryCache(),
    )
    server.script(Reply(status=500), Reply(text="fine"), Reply(status=400, error="bad params"))
    path = tmp_path / "calls.jsonl"
    async with model:
        with log_calls(path):
            await model.complete([{"role": "user", "content": "hi"}])
            await model.complete([{"role": "user", "content": "hi"}])  # cached
            with pytest.raises(Exception, match="bad params"):
                await model.complete([{"role": "user", "content": "other"}])
    retried, cached, failed = lines(path)
    assert retried["attempts"] == 2 and retried["retries"] == 1 and retried["reply"] == "fine"
    assert retried["retried_after"] == ["ModelServerError"]  # why it was retried
    assert retried["cost_usd"] is None  # no price known for "my-local-model"
    assert cached["cached"] is True and cached["attempts"] == 0 and cached["reply"] == "fine"
    assert failed["reply"] is None and "bad params" in str(failed["error"])
    assert failed["attempts"] == 1 and failed["retried_after"] == []


async def test_calls_made_in_a_backward_name_their_node_and_trace(tmp_path: Path) -> None:
    answers = [Parameter(f"answer {i}", role="answer") for i in range(3)]
    report = concat(*[Critique.apply(a) for a in answers])
    path = tmp_path / "calls.jsonl"
    async with trace_pass() as timeline, log_calls(path):
        await report.backward()
    records = read_call_log(path)
    assert len(records) == 3
    assert {r["trace_id"] for r in records} == {timeline.trace_id}
    seqs = sorted(r["node"]["seq"] for r in records)
    assert seqs == sorted([list(a_out.seq) for a_out in _critique_nodes(report)])
    assert all(r["node"]["function"] == "Critique" for r in records)
    assert all(r["node"]["inputs"] == ["answer"] for r in records)


def _critique_nodes(report: object) -> list:  # type: ignore[type-arg]
    node = report.grad_fn  # type: ignore[attr-defined]
    return [edge[0] for edge in node.next_edges if edge is not None]


async def test_nothing_is_logged_outside_the_block_and_a_cut_line_is_skipped(
    tmp_path: Path,
) -> None:
    model = SimulatedModel(latency_s=0)
    path = tmp_path / "calls.jsonl"
    with log_calls(path, append=False):
        await model.complete([{"role": "user", "content": "one"}])
    await model.complete([{"role": "user", "content": "two"}])
    with path.open("a") as f:
        f.write('{"model": "cut sh')  # a line still being written
    records = read_call_log(path)
    assert len(records) == 1
    assert records[0]["cost_usd"] == 0.0  # a simulated call costs nothing, by definition


async def test_the_log_is_private_and_urls_in_it_lose_their_credentials(
    tmp_path: Path, server: OpenAITestServer
) -> None:
    base_url = server.url.replace("http://", "http://user:pa55-w0rd-secret@")
    model = OpenAIChat("gpt-4o-mini", base_url=base_url, api_key="k")
    path, trace = tmp_path / "calls.jsonl", tmp_path / "trace.json"
    path.write_text("")
    path.chmod(0o644)  # an existing file is narrowed too
    async with model, log_calls(path), trace_pass(trace):
        await model.complete([{"role": "user", "content": "hi"}])
    text = path.read_text()
    assert "pa55-w0rd-secret" not in text and "user:***@" in text
    (record,) = lines(path)
    assert record["endpoint"] == base_url.replace("pa55-w0rd-secret", "***")
    assert path.stat().st_mode & 0o777 == 0o600
    assert trace.stat().st_mode & 0o777 == 0o600
    assert "pa55-w0rd-secret" not in trace.read_text()
