"""A model client's secrets are masked in every output, in the forms servers echo them: its
API key, its base URL's credentials, and the values of its headers (those whose names say
they hold a credential, and those marked ``Secret``), against a real local HTTP server."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgraph._redact import redact
from asyncgraph.models import ModelStatusError, OpenAIChat, Secret
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.observe import log_calls, read_call_log

pytestmark = pytest.mark.anyio

API_KEY = "sk-proj-Zq81hKx0Pw5vLm3NcT7bYd2R"
HEADER_TOKEN = "hdr-tok-9Fk2Lm8Qx4Vz7Pw1"
MARKED = "tenant-pass-Jm4Rq8Zx3"
PLAIN = "req-source-batch-nightly"  # a header that is no credential: left as it is
SECRETS = (API_KEY, HEADER_TOKEN, MARKED)


def echo() -> str:
    """What an echoing server says of the request's credentials: upper- and lower-cased,
    without a prefix, split by a space, cut short, and the plain header as it is."""
    return (
        f"key {API_KEY.upper()}, key {API_KEY.removeprefix('sk-proj-')}, "
        f"token {HEADER_TOKEN[:10]} {HEADER_TOKEN[10:]}, tenant {MARKED.lower()}, "
        f"cut {API_KEY[8:22]}..., from {PLAIN}"
    )


def gives_away(text: str) -> list[str]:
    flat = "".join(text.split()).lower()
    return [s for s in SECRETS if s.lower()[-12:] in flat or s.lower()[8:20] in flat]


def model_of(server: OpenAITestServer) -> OpenAIChat:
    return OpenAIChat(
        "test-model",
        base_url=server.url,
        api_key=API_KEY,
        headers={"X-Auth-Token": HEADER_TOKEN, "X-Tenant": Secret(MARKED), "X-Source": PLAIN},
    )


async def test_the_headers_reach_the_server_and_no_echo_of_them_comes_back(
    server: OpenAITestServer, tmp_path: Path
) -> None:
    model = model_of(server)
    server.script(Reply(text=f"you sent {echo()}"), Reply(status=401, error=f"denied: {echo()}"))
    with log_calls(tmp_path / "calls.jsonl"):
        answer = await model.complete([{"role": "user", "content": "hi"}])
        with pytest.raises(ModelStatusError) as refused:
            await model.complete([{"role": "user", "content": "again"}])
    sent = server.requests[0].headers
    assert sent["authorization"] == f"Bearer {API_KEY}" and sent["x-tenant"] == MARKED
    assert sent["x-auth-token"] == HEADER_TOKEN and sent["x-source"] == PLAIN
    # The answer, the error and the call log: each form masked, the plain header kept.
    for shown in (answer.text, str(refused.value), (tmp_path / "calls.jsonl").read_text()):
        assert gives_away(shown) == [], shown
        assert PLAIN in shown
    assert "[redacted]" in answer.text


async def test_a_models_secrets_are_masked_in_the_rest_of_the_process_too(
    server: OpenAITestServer,
) -> None:
    model_of(server)  # made, never called: its secrets are known from now on
    line = f"a log line of another task: {echo()}"
    assert gives_away(redact(line)) == [] and PLAIN in redact(line)


def test_a_call_log_read_back_holds_the_masked_reply(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    Secret(MARKED)
    with log_calls(path) as log:
        log.write({"reply": f"tenant {MARKED.upper()}", "model": "m"})
    assert read_call_log(path) == [{"reply": "tenant [redacted]", "model": "m"}]
