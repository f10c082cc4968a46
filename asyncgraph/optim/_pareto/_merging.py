"""Merging two candidates that are each best on examples where the other is not.

Per parameter, the merge takes the value both share, or the version that changed since
their latest common ancestor (``changes``: pure). Where both changed a text, the model
writes a merge of the two (``Merger.merge_text``), asked for as TGD asks for its updates:
as a structured output where the model takes one, else between TGD's tags (the prompt is
``merge_messages``); where both changed a value that is not text, the better parent's
is kept. A merge that cannot be read, or that equals a parent, is no child.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgraph import Module
from asyncgraph._exceptions import UpdateParseError
from asyncgraph.models import BaseChatModel, ChatModel, reply_tokens
from asyncgraph.optim._frontier import Candidate, ancestors, by_id
from asyncgraph.optim._prompts import ValueForm, merge_messages
from asyncgraph.optim._tgd import DEFAULT_TAGS, SkippedUpdate, parse_value
from asyncgraph.text import (
    ask_json,
    current_models,
    describe,
    run_all,
    update_tokens,
    uses_structured,
)

from ._outcome import Outcome

__all__ = ["MERGE_FIELD", "Merger", "changes"]

MERGE_FIELD = "merged_variable"
"""The JSON field a merge comes back in when it is asked for with ``response_format``."""


def changes(
    a: Candidate, b: Candidate, ancestor: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Per parameter of ``a`` and ``b``: the merged value where one is known without a
    model (the shared value, the one that changed since ``ancestor``, or for values that
    are not text the better parent's), and the names of the texts both changed."""
    merged: dict[str, Any] = {}
    asks: list[str] = []
    for name, first in a.values.items():
        second, base = b.values[name], ancestor.get(name)
        if first == second or second == base:
            merged[name] = first
        elif first == base:
            merged[name] = second
        elif isinstance(first, str) and isinstance(second, str):
            asks.append(name)
        else:
            merged[name] = first if a.mean >= b.mean else second
    return merged, asks


@dataclass
class Merger:
    """Merges candidates of the parameters of ``module``; ``model()`` is the model that
    writes the merges of texts (resolved when one is due), asked as ``tgd_options`` say
    (``tags``, ``structured``, ``model_params``)."""

    module: Module
    model: Callable[[], ChatModel]
    tgd_options: Mapping[str, Any]
    skipped: list[SkippedUpdate] = field(default_factory=list)
    """The merges that could not be read (the search's ``skipped``)."""

    async def child(
        self, pool: Sequence[Candidate], a: Candidate, b: Candidate, outcome: Outcome
    ) -> dict[str, Any] | None:
        """The merge of ``a`` and ``b`` (candidates of ``pool``); None, with a note, when
        it cannot be read or equals a parent."""
        merged = await self.merged_values(pool, a, b, outcome)
        if merged is not None and merged in (a.values, b.values):
            outcome.note = "merge equals a parent"
            return None
        return merged

    async def merged_values(
        self, pool: Sequence[Candidate], a: Candidate, b: Candidate, outcome: Outcome
    ) -> dict[str, Any] | None:
        """Per parameter: the ``changes`` of ``a`` and ``b``, and a merge written by the
        model for each text both changed. None, with a note, if one is unreadable."""
        common = ancestors(pool, a.id) & ancestors(pool, b.id)
        ancestor = by_id(pool, max(common)).values if common else {}
        merged, asks = changes(a, b, ancestor)
        if not asks:
            return merged
        model = self.model()
        roles = {n: p.role for n, p in self.module.named_parameters()}

        async def ask(name: str) -> None:
            merged[name] = await self.merge_text(
                model, roles.get(name, name), a.values[name], b.values[name], ancestor.get(name)
            )

        await run_all([functools.partial(ask, name) for name in asks])
        outcome.stages.append("merge")
        unreadable = [name for name in asks if not merged[name]]
        if unreadable:
            outcome.note = f"merge of {unreadable[0]!r} unreadable"
            return None
        return {name: merged[name] for name in a.values}

    async def merge_text(
        self, model: ChatModel, role: str, first: str, second: str, ancestor: Any
    ) -> str | None:
        """A merge written by ``model``, asked for as TGD asks for updates (structured
        outputs where the model takes them, else tags); None when it is unreadable."""
        open_tag, close_tag = self.tgd_options.get("tags", DEFAULT_TAGS)
        structured = self.tgd_options.get("structured", "auto")
        tags = ValueForm(open_tag, close_tag)
        form = (
            ValueForm(open_tag, close_tag, MERGE_FIELD)
            if uses_structured(model, structured, unknown=False)
            else tags
        )

        def request(form: ValueForm) -> list[dict[str, Any]]:
            return merge_messages(
                role=describe(role, "variable"),
                first=first,
                second=second,
                ancestor=ancestor if isinstance(ancestor, str) else None,
                open_tag=open_tag,
                close_tag=close_tag,
                form=form,
            )

        params = self.tgd_options.get("model_params")
        if params is None:
            params = current_models().for_feedback()[2]
        with reply_tokens(update_tokens(first) + update_tokens(second), whole=True):
            if form.field is not None:
                completion, sent = await ask_json(
                    model,
                    request(form),
                    params,
                    form.schema(),
                    structured=structured,
                    fallback=request(tags),
                    strict=True,
                    usable=lambda text: bool(parse_value(text, form)),
                )
                text = completion.text
                value = parse_value(text, form if sent else tags)
            else:
                messages = request(tags)
                if isinstance(model, BaseChatModel):
                    reply = await model.complete(
                        messages, cache_if=lambda c: bool(parse_value(c.text, tags)), **params
                    )
                else:
                    reply = await model.complete(messages, **params)
                text, sent = reply.text, False
                value = parse_value(text, tags)
        if not value:
            if self.tgd_options.get("strict"):  # as TGD(strict=True) does with a rewrite
                raise UpdateParseError(
                    f"ParetoSearch could not read the merge of the parameter with role "
                    f"{role!r}: the model's reply has no merged value. Last reply "
                    f"({len(text)} chars): {text[:200]!r}. Use structured outputs "
                    f"(tgd_options={{'structured': True}}) or leave strict off to skip it.",
                    role=role,
                    attempts=1,
                    reply=text,
                )
            self.skipped.append(SkippedUpdate(role, attempts=1, reply=text, structured=sent))
        return value or None
