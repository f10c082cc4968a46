"""A scripted model for the optimizer tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncgraph.models import SimulatedModel

VARIABLE = re.compile(r"<VARIABLE>(.*?)</VARIABLE>", re.DOTALL)


def improve(messages: list[dict[str, Any]]) -> str:
    """``<IMPROVED_VARIABLE>{value}+</IMPROVED_VARIABLE>``: the value with a '+' appended."""
    found = VARIABLE.findall(messages[1]["content"])
    return f"Here you go.\n<IMPROVED_VARIABLE>{found[-1]}+</IMPROVED_VARIABLE>"


class Script:
    """A SimulatedModel (no latency, untagged) answering with ``responder``, recording requests."""

    def __init__(self, responder: Callable[[list[dict[str, Any]]], Any] = improve) -> None:
        self.requests: list[list[dict[str, Any]]] = []
        self.responder = responder

        async def respond(messages: list[dict[str, Any]]) -> str:
            self.requests.append(messages)
            result = self.responder(messages)
            if hasattr(result, "__await__"):
                result = await result
            return str(result)

        self.model = SimulatedModel(latency_s=0.0, responder=respond, tag_replies=False)

    def contents(self) -> list[str]:
        return [m[-1]["content"] for m in self.requests]
