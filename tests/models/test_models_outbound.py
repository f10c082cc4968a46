"""The one outbound policy (NOTE [Outbound policy] in ``asyncgraph.models._outbound``):
in a process where a worker serves, every provider's call params pass one check before
anything is sent, against real local HTTP servers that record every request."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from asyncgraph.models import (
    AnthropicChat,
    AzureOpenAIChat,
    BaseChatModel,
    MemoryCache,
    ModelConfigError,
    ModelRequestError,
    OpenAIChat,
    SimulatedModel,
    parse_model_spec,
)
from asyncgraph.models._http import HttpChatModel
from asyncgraph.models._litellm import LiteLLMChat
from asyncgraph.models._outbound import (
    CHAT_PARAMS,
    CREDENTIAL_PARAMS,
    DESTINATION_PARAMS,
    normalize_base_url,
    param_refusal,
)
from asyncgraph.models._spec import restrict_base_urls
from asyncgraph.models._testing import OpenAITestServer, Reply
from asyncgraph.models._testing_providers import AnthropicTestServer, AzureOpenAITestServer

# LiteLLM fetches its price map from the network when imported, unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytestmark = [
    pytest.mark.anyio,
    # LiteLLM's own imports (pydantic schemas of its auth flows); nothing of asyncgraph.
    pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning"),
]

needs_litellm = pytest.mark.skipif(
    importlib.util.find_spec("litellm") is None, reason="the litellm extra is not installed"
)

KEY = "sk-worker-key-that-must-not-leak-0001"  # the worker's own key, for every provider
HELLO = [{"role": "user", "content": "hello there"}]


@dataclass(frozen=True)
class Client:
    """A provider's client at its own (allowed) test server, with the worker's key."""

    server: Callable[[], OpenAITestServer]
    build: Callable[[str], BaseChatModel]
    # The params that choose where its request goes (LiteLLM's); none for a client that
    # only puts params in a JSON body.
    routes: frozenset[str] = frozenset()


@functools.cache
def _litellm_ready() -> None:
    """Import LiteLLM once, and keep its redaction filter off httpx's logger, as
    test_models_litellm does (the tests of asyncgraph's own redaction must not see it)."""
    import logging

    import litellm  # noqa: F401

    for found in list(logging.getLogger("httpx").filters):
        if type(found).__module__.startswith("litellm"):
            logging.getLogger("httpx").removeFilter(found)


# The openai SDK LiteLLM sends with reads platform.processor() for its first request's
# headers, which runs `uname -p` once per process: read here, at collection, so no fast
# test starts that process (tests/conftest.py fails one that does).
platform.processor()


def _litellm_client(url: str) -> BaseChatModel:
    _litellm_ready()
    # As a worker builds "litellm:openai/gpt-test" from a task: no base_url, LiteLLM's
    # default destination; a call's api_base / base_url would choose another.
    return parse_model_spec("litellm:openai/gpt-test", cache=None, rate_limit=None)


def _closing_server() -> OpenAITestServer:
    """A server whose every answer closes its connection: LiteLLM keeps its HTTP clients
    for the whole process, and a connection it kept to a stopped server would be an
    unclosed socket when the test run ends."""
    return OpenAITestServer(handler=lambda body: Reply(headers={"Connection": "close"}))


CLIENTS: dict[str, Client] = {
    "OpenAIChat": Client(OpenAITestServer, lambda url: OpenAIChat("gpt-test", base_url=url)),
    "AzureOpenAIChat": Client(
        lambda: AzureOpenAITestServer(api_key=KEY),
        lambda url: AzureOpenAIChat("test-deployment", endpoint=url),
    ),
    "AnthropicChat": Client(
        lambda: AnthropicTestServer(api_key=KEY),
        lambda url: AnthropicChat("claude-test", base_url=url),
    ),
    "LiteLLMChat": Client(
        _closing_server, _litellm_client, routes=frozenset({"api_base", "base_url"})
    ),
    "SimulatedModel": Client(OpenAITestServer, lambda url: SimulatedModel(latency_s=0)),
}
NAMES = [
    pytest.param(name, marks=needs_litellm) if name == "LiteLLMChat" else name for name in CLIENTS
]
# What a refused credential param carries in these tests (none of it may be sent).
CREDENTIAL_VALUES: dict[str, Any] = {
    "api_key": "sk-attacker-000000000000",
    "headers": {"authorization": "Bearer attacker"},
    "extra_headers": {"x-forwarded-host": "attacker.example"},
    "default_headers": {"authorization": "Bearer attacker"},
    "extra_query": {"api-key": "attacker"},
    "azure_ad_token": "attacker-token",
    "azure_ad_token_provider": "attacker",
    "organization": "org-attacker",
}
# LiteLLM's own keywords that choose an endpoint, carry credentials or add a sink.
LITELLM_OWN = [
    ("aws_access_key_id", "AKIAATTACKER"),
    ("aws_secret_access_key", "attacker-secret"),
    ("aws_session_token", "attacker-token"),
    ("aws_region_name", "us-east-1"),
    ("aws_bedrock_runtime_endpoint", "http://127.0.0.1:9/bedrock"),
    ("aws_sts_endpoint", "http://127.0.0.1:9/sts"),
    ("vertex_credentials", '{"type": "service_account"}'),
    ("vertex_project", "attacker-project"),
    ("vertex_location", "us-central1"),
    ("custom_llm_provider", "openai"),
    ("api_version", "2024-10-21"),
    ("deployment_id", "attacker"),
    ("model_list", [{"model_name": "x", "litellm_params": {"model": "openai/x"}}]),
    ("fallbacks", ["openai/gpt-4o"]),
    ("ssl_verify", False),
    ("use_litellm_proxy", True),
    ("litellm_credential_name", "prod"),
    ("langsmith_base_url", "http://127.0.0.1:9/langsmith"),
    ("success_callback", ["langsmith"]),
    ("metadata", {"headers": {"authorization": "Bearer attacker"}}),
    ("timeout", 1),
]


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's key for every provider, and no provider URL from the environment."""
    for variable in (
        "OPENAI_BASE_URL",
        "ANTHROPIC_BASE_URL",
        "AZURE_OPENAI_ENDPOINT",
        "ASYNCGRAPH_ALLOWED_BASE_URLS",
        "ASYNCGRAPH_MODEL_CACHE",
        "ASYNCGRAPH_MODEL_RPM",
        "ASYNCGRAPH_MODEL_TPM",
    ):
        monkeypatch.delenv(variable, raising=False)
    for variable in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AZURE_OPENAI_API_KEY"):
        monkeypatch.setenv(variable, KEY)


@pytest.fixture
def elsewhere() -> Iterator[OpenAITestServer]:
    """A server the operator did not allow: it records any request that reaches it."""
    with _closing_server() as server:
        yield server


@dataclass
class Worker:
    """One client under a worker's policy: its model, its allowed server, and elsewhere."""

    model: BaseChatModel
    allowed: OpenAITestServer
    elsewhere: OpenAITestServer
    client: Client

    def nothing_sent(self) -> bool:
        return self.allowed.requests == [] and self.elsewhere.requests == []


@pytest.fixture(params=NAMES)
async def worker(request: pytest.FixtureRequest, keys: None, elsewhere: OpenAITestServer) -> Any:
    """Each provider's client, in a process where a worker serves allowing only its own
    server (restrict_base_urls, as ``asyncgraph worker --allow-base-url`` does)."""
    client = CLIENTS[request.param]
    with client.server() as allowed:
        model = client.build(allowed.url)
        restriction = restrict_base_urls([allowed.url])
        try:
            yield Worker(model, allowed, elsewhere, client)
        finally:
            restriction.remove()
            await model.aclose()


@pytest.mark.parametrize("param", sorted(DESTINATION_PARAMS))
async def test_every_provider_refuses_a_destination_param_the_operator_did_not_allow(
    worker: Worker, param: str
) -> None:
    url = worker.elsewhere.url
    with pytest.raises(ModelConfigError) as refused:
        await worker.model.complete(HELLO, **{param: url})
    message = str(refused.value)
    assert f"param {param}={url!r} is not allowed in this process" in message
    assert f"--allow-base-url {url}" in message and "ASYNCGRAPH_ALLOWED_BASE_URLS" in message
    assert refused.value.variable == param
    assert worker.nothing_sent()


@pytest.mark.parametrize("param", sorted(CREDENTIAL_PARAMS))
async def test_every_provider_refuses_every_credential_or_header_param(
    worker: Worker, param: str
) -> None:
    value = CREDENTIAL_VALUES[param]
    with pytest.raises(ModelConfigError, match=f"param '{param}' is refused") as refused:
        await worker.model.complete(HELLO, **{param: value})
    assert "its value is not shown" in str(refused.value) and "attacker" not in str(refused.value)
    assert worker.nothing_sent()


@pytest.mark.parametrize("param", sorted(DESTINATION_PARAMS))
async def test_an_allowed_destination_param_passes_and_the_key_goes_only_there(
    worker: Worker, param: str
) -> None:
    if worker.client.routes and param not in worker.client.routes:
        pytest.skip(
            f"LiteLLM takes no {param} keyword (its Azure models take api_base): an allowed "
            "one passes the policy (test_the_decision_...), and LiteLLM would then send the "
            "request to the model's default URL, which a test must not reach"
        )
    # Written another way than the operator wrote it: the policy compares normalized URLs.
    url = worker.allowed.url.replace("http://", "HTTP://") + "/"
    try:
        answer = await worker.model.complete(HELLO, **{param: url})
    except ModelRequestError:  # Anthropic's API takes no such body field (a 400), as documented
        assert isinstance(worker.model, AnthropicChat)
        answer = None
    assert worker.elsewhere.requests == []
    if isinstance(worker.model, SimulatedModel):
        assert answer is not None and worker.allowed.requests == []  # it sends nothing
        return
    (sent,) = worker.allowed.requests
    if worker.client.routes:  # LiteLLM sent the request, with the key, there
        assert answer is not None and answer.text == "echo: hello there"
        assert sent.headers["authorization"] == f"Bearer {KEY}" and param not in sent.body
    else:  # an HTTP client posts to its own URL; the param is only a field of the body
        assert sent.body[param] == url
        assert any(KEY in value for value in sent.headers.values())  # its own header


@needs_litellm
@pytest.mark.parametrize(("param", "value"), LITELLM_OWN, ids=[p for p, _ in LITELLM_OWN])
async def test_litellm_refuses_its_own_routing_credential_and_callback_keywords(
    keys: None, elsewhere: OpenAITestServer, param: str, value: Any
) -> None:
    model = _litellm_client(elsewhere.url)
    restriction = restrict_base_urls([elsewhere.url])  # even with an allowed api_base
    try:
        with pytest.raises(ModelConfigError, match=f"param '{param}' is refused") as refused:
            await model.complete(HELLO, api_base=elsewhere.url, **{param: value})
    finally:
        restriction.remove()
    message = str(refused.value)
    assert "LiteLLMChat hands its params to a library" in message
    assert "temperature" in message and "--import" in message
    assert elsewhere.requests == []


@needs_litellm
async def test_litellm_sends_the_chat_params_a_task_gives(
    keys: None, elsewhere: OpenAITestServer
) -> None:
    model = _litellm_client(elsewhere.url)
    restriction = restrict_base_urls([elsewhere.url])
    try:
        answer = await model.complete(
            HELLO, api_base=elsewhere.url, temperature=0, max_tokens=7, seed=3, stop=["\n"]
        )
    finally:
        restriction.remove()
    assert answer.text == "echo: hello there"
    (sent,) = elsewhere.requests
    assert {k: sent.body[k] for k in ("temperature", "max_tokens", "seed", "stop")} == {
        "temperature": 0,
        "max_tokens": 7,
        "seed": 3,
        "stop": ["\n"],
    }


@needs_litellm
@pytest.mark.parametrize("param", ["api_base", "base_url"])
async def test_the_issues_case_a_task_cannot_point_litellm_and_the_workers_key_elsewhere(
    keys: None, elsewhere: OpenAITestServer, param: str
) -> None:
    # Issue #33: a client with no key sent params={"api_base": ...} with a litellm: spec,
    # and the worker sent "Authorization: Bearer <its OPENAI_API_KEY>" there.
    model = _litellm_client("")
    restriction = restrict_base_urls([])  # a worker with no --allow-base-url
    try:
        with pytest.raises(ModelConfigError, match="--allow-base-url"):
            await model.complete(HELLO, **{param: elsewhere.url})
    finally:
        restriction.remove()
    assert elsewhere.requests == []


@needs_litellm
async def test_an_application_may_send_its_own_key_where_it_chooses(
    keys: None, elsewhere: OpenAITestServer
) -> None:
    # No worker serves in this process: the user's own code, the user's own key.
    model = _litellm_client("")
    answer = await model.complete(HELLO, api_base=elsewhere.url)
    assert answer.text == "echo: hello there"
    assert elsewhere.requests[0].headers["authorization"] == f"Bearer {KEY}"
    async with OpenAIChat("gpt-test", base_url=elsewhere.url) as client:
        await client.complete(HELLO, api_key="sk-a-body-field-0000")  # a body field, as before
    assert elsewhere.requests[1].body["api_key"] == "sk-a-body-field-0000"


async def test_a_refused_call_is_not_answered_from_the_cache_either(keys: None) -> None:
    model = SimulatedModel(latency_s=0, cache=MemoryCache())
    await model.complete(HELLO, api_key="sk-cached-0000000000")  # an application's call
    restriction = restrict_base_urls([])
    try:
        with pytest.raises(ModelConfigError, match="param 'api_key' is refused"):
            await model.complete(HELLO, api_key="sk-cached-0000000000")
    finally:
        restriction.remove()
    assert model.usage.snapshot().cache_hits == 0


def _clients() -> set[type[BaseChatModel]]:
    """Every model client class asyncgraph.models defines."""
    found, stack = set(), [BaseChatModel]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("asyncgraph.models.") and sub is not HttpChatModel:
                found.add(sub)
    return found


def test_every_client_is_tested_here_and_none_bypasses_the_one_check() -> None:
    clients = _clients()
    # A new provider fails here until it is added to CLIENTS (and so to every test above).
    assert {cls.__name__ for cls in clients} == set(CLIENTS)
    for cls in clients:
        # complete() is where the policy runs, before the cache, the journal and any send.
        assert cls.complete is BaseChatModel.complete, cls
        assert cls._complete_with_retries is BaseChatModel._complete_with_retries, cls
    assert HttpChatModel.request_params is None and SimulatedModel.request_params is None
    assert LiteLLMChat.request_params is not None
    assert not LiteLLMChat.request_params & (DESTINATION_PARAMS | CREDENTIAL_PARAMS)
    assert BaseChatModel.request_params == CHAT_PARAMS  # the strict default of a new client


def test_the_decision_names_the_param_and_never_shows_a_credential() -> None:
    allowed = frozenset({normalize_base_url("http://vllm:8000/v1")})

    def why(name: str, value: Any, request_params: frozenset[str] | None = None) -> str | None:
        return param_refusal(
            name, value, allowed=allowed, request_params=request_params, client="C"
        )

    assert why("api_base", "HTTP://VLLM:8000/v1/") is None
    assert why("base_url", "http://vllm:8000/v1/extra") is not None  # another path
    for odd in (None, 8000, {"url": "http://vllm:8000/v1"}, "vllm:8000/v1", ""):
        assert why("api_base", odd) is not None
    shown = why("api_base", "http://user:hunter2@evil.example/v1?api-key=s3cret")
    assert shown is not None and "hunter2" not in shown and "s3cret" not in shown
    assert why("api_key", "sk-secret-value-000000") is not None
    assert "sk-secret" not in (why("api_key", "sk-secret-value-000000") or "")
    assert why("temperature", 0) is None  # any other name, for a body-only client
    assert why("temperature", 0, frozenset({"temperature"})) is None
    reason = why("vertex_project", "p", frozenset({"temperature"}))
    assert reason is not None and "'vertex_project' is refused" in reason
