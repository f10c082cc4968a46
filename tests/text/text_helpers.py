"""Scripted models for the text tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from asyncgraph._core._arith import Add
from asyncgraph.distributed import (
    RedisExecutor,
    Worker,
    WorkerConfig,
    build_registry,
    open_redis_executor,
)
from asyncgraph.models import Completion, SimulatedModel
from asyncgraph.text import DeterministicEvaluator

ROLE = re.compile(r"<ROLE>(.*?)</ROLE>", re.DOTALL)
OUTPUT_ROLE = re.compile(r"The output of this call is (.*?)\.\n")


def is_feedback_request(messages: list[dict[str, Any]]) -> bool:
    return "<VARIABLE>" in messages[-1]["content"] and "<ROLE>" in messages[-1]["content"]


def path_responder(messages: list[dict[str, Any]]) -> str:
    """Forward: ``out(<user message>)``. Feedback: ``fix <variable role> for <output role>``.

    Feedback that names its path lets a test derive every gradient by hand.
    """
    content = messages[-1]["content"]
    if is_feedback_request(messages):
        role = ROLE.search(content)
        output = OUTPUT_ROLE.search(content)
        assert role is not None and output is not None, content
        return f"fix {role[1]} for {output[1]}"
    return f"out({content})"


class Recorder:
    """A SimulatedModel (no latency, untagged replies) that records every request."""

    def __init__(self, responder: Callable[[list[dict[str, Any]]], Any] = path_responder) -> None:
        self.requests: list[list[dict[str, Any]]] = []
        self._responder = responder

        async def respond(messages: list[dict[str, Any]]) -> str:
            self.requests.append(messages)
            result = self._responder(messages)
            if hasattr(result, "__await__"):
                result = await result
            return str(result)

        self.model = SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False)

    def feedback_requests(self) -> list[str]:
        return [m[-1]["content"] for m in self.requests if is_feedback_request(m)]


class NamedModel:
    """A ChatModel (the protocol, not BaseChatModel) that logs ``(name, params, messages)``.

    Replies like ``path_responder``, prefixed with the model's name, so a test can tell
    which model answered each request and with which params; to an optimizer's update
    request, ``<IMPROVED_VARIABLE>edited by NAME</IMPROVED_VARIABLE>``.
    """

    def __init__(self, name: str, log: list[tuple[str, dict[str, Any], list[dict[str, Any]]]]):
        self.name = name
        self.log = log

    async def complete(self, messages: list[dict[str, Any]], **params: Any) -> Completion:
        self.log.append((self.name, dict(params), messages))
        if "IMPROVED_VARIABLE" in messages[-1]["content"]:
            text = f"<IMPROVED_VARIABLE>edited by {self.name}</IMPROVED_VARIABLE>"
            return Completion(text, model=self.name)
        return Completion(f"{self.name}: {path_responder(messages)}", model=self.name)


# --- Remote variants of Functions that default to dispatch = "local" --------------------
# A worker serving ``--import text_helpers`` (``build_registry(["text_helpers"])``) runs
# their backward, which shows that their ctx is plain data that crosses the wire.


class RemoteEvaluator(DeterministicEvaluator):
    dispatch = "remote"


class RemoteAdd(Add):
    dispatch = "remote"


@asynccontextmanager
async def remote_executor(
    redis_url: str, queue: str, modules: list[str]
) -> AsyncIterator[RedisExecutor]:
    """A worker serving ``modules`` in this process, and an executor sending to it."""
    worker = Worker(WorkerConfig(redis_url, queue=queue, lease_ms=1000), build_registry(modules))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(worker.serve)
            async with open_redis_executor(redis_url, queue=queue, timeout_s=20) as executor:
                yield executor
            worker.drain()
