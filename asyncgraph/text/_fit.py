"""Requests that fit the model's context window: the feedback budgets, the optimizer's
update and its condensing sized to the window, with room for the reply.

A budget here is in ``approx_tokens`` (4 characters each), the unit of feedback budgets;
a model's window is in its own tokens, counted erring high (``ModelLimits``: 3 characters
a token until the server's usage shows better). ``Fit`` converts between the two.

- ``room(messages, reply)``: what a request built around ``messages`` (every part but the
  one being sized) leaves for that part, in ``approx_tokens``, after room for its reply
  (the ``max_tokens`` a suggested reply of ``reply`` tokens is sent with, at most a
  quarter of the window) and a margin; a negative room is ``too_long``'s error, which
  names the parts and their sizes and what to set;
- ``condense_tokens()``: the most feedback one summary request may carry and still fit
  with its instruction and its reply (a summary of up to that size), so the map-reduce of
  ``condense_feedback`` never sends a request the window cannot take.

A model that says nothing of its window (``limits()`` without ``context_tokens``, or a
``ChatModel`` without ``limits``) gets no ``Fit``: budgets stay as set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgraph.models import BaseChatModel, ChatModel, ModelContextError, ModelLimits

__all__ = ["Fit", "fit_for", "fitted_budget"]

_MARGIN = 32  # model tokens kept free besides the reply: the estimate errs, servers add
_SUMMARY_OVERHEAD = 200  # approx tokens of a summary request's instruction and framing
MIN_FEEDBACK_TOKENS = 32  # approx tokens of feedback a request must have room for
SHORT_REPLY_TOKENS = 128  # a feedback reply's tokens when its share of the window leaves none


@dataclass(frozen=True)
class Fit:
    """A model's context window, for sizing requests (see the module docstring)."""

    model: str
    limits: ModelLimits

    @property
    def context(self) -> int:
        assert self.limits.context_tokens is not None
        return self.limits.context_tokens

    def approx(self, model_tokens: int) -> int:
        """``model_tokens`` of this model as ``approx_tokens`` (4 characters each)."""
        return math.floor(model_tokens * self.limits.chars_per_token / 4)

    def room(
        self, messages: Sequence[Mapping[str, Any]], reply: int, *, whole: bool = False
    ) -> int:
        """``approx_tokens`` left for one more part of a request made of ``messages`` with
        a reply of ``reply`` model tokens (negative: it does not fit as it is); ``whole``
        as for ``reply``."""
        used = self.limits.count(messages) + self.reply(reply, whole=whole) + _MARGIN
        return self.approx(self.context - used)

    def feedback_room(
        self, probes: Sequence[Sequence[Mapping[str, Any]]], reply: int
    ) -> tuple[int, int]:
        """``(room, reply)`` for feedback in the largest of ``probes`` (the requests built
        without it): with a reply of ``reply`` tokens, or, when that leaves less than
        ``MIN_FEEDBACK_TOKENS`` and the model has no ``max_tokens`` of its own, with
        ``SHORT_REPLY_TOKENS`` (the model then sends what is left as its ``max_tokens``)."""
        room = min(self.room(probe, reply) for probe in probes)
        if room < MIN_FEEDBACK_TOKENS and self.limits.max_tokens is None:
            reply = min(reply, SHORT_REPLY_TOKENS)
            room = min(self.room(probe, reply) for probe in probes)
        return room, reply

    def reply(self, tokens: int, *, whole: bool = False) -> int:
        """The room kept for a reply suggested to be ``tokens`` long: the ``max_tokens``
        it is sent with (``ModelLimits.reply_tokens``; ``whole`` for an optimizer's new
        value, which is not held to a share of the window), at most a quarter of the
        window (a longer reply is cut to what the request leaves, by the model)."""
        return min(self.limits.reply_tokens(tokens, whole=whole), self.context // 4)

    def condense_tokens(self) -> int:
        """The most feedback (``approx_tokens``) one summary request may carry, so that
        it, its instruction and a summary as long as it fit the window."""
        window = self.approx(self.context - _MARGIN)
        return max(16, int((window - _SUMMARY_OVERHEAD) / 2.5))

    def too_long(
        self,
        what: str,
        parts: Mapping[str, str],
        reply: int,
        *,
        request: Sequence[Mapping[str, Any]] | None = None,
    ) -> ModelContextError:
        """The error for a request (``what``) whose fixed ``parts`` leave no room; with
        the ``request`` as it would be sent, what its instructions and framing take
        besides the parts is listed too."""
        sizes = sorted(
            ((name, self.limits.tokens(text)) for name, text in parts.items()),
            key=lambda item: -item[1],
        )
        listed = ", ".join(f"{name} about {size:,}" for name, size in sizes)
        if request is not None:
            rest = self.limits.count(request) - sum(size for _, size in sizes)
            if rest > 0:
                listed += f", and the instructions and framing about {rest:,}"
        source = {"given": "context_tokens=", "server": "the server", "table": "the table"}
        return ModelContextError(
            f"{self.model!r}: {what} does not fit the context window of {self.context:,} "
            f"tokens (from {source.get(self.limits.source, 'the model')}) with a reply of "
            f"{reply:,}: its parts take, in tokens, {listed}. The longest is "
            f"{sizes[0][0]}: shorten it, give the model a larger window (context_tokens= if "
            "the server's is larger than it says, or a model with a larger one), or lower "
            "the reply's max_tokens",
            model=self.model,
            context_tokens=self.context,
            reply_tokens=reply,
        )


async def fit_for(model: ChatModel) -> Fit | None:
    """The ``Fit`` of ``model``, or None when its window is unknown."""
    if not isinstance(model, BaseChatModel):
        return None
    limits = await model.limits()
    if limits.context_tokens is None:
        return None
    return Fit(model.name, limits)


async def fitted_budget(
    model: ChatModel,
    budget: int | None,
    probes: Sequence[Sequence[Mapping[str, Any]]],
    parts: Mapping[str, str],
    what: str,
    reply: int,
) -> tuple[int | None, int | None]:
    """``budget`` lowered to what ``model``'s window leaves for feedback in the largest of
    ``probes`` (the requests built without their feedback) with a reply of ``reply``
    tokens, and the summary chunk size (``(budget, None)`` when the window is unknown);
    ``ModelContextError`` naming ``parts`` when there is no room for
    ``MIN_FEEDBACK_TOKENS`` of it, even with a reply of ``SHORT_REPLY_TOKENS``."""
    fit = await fit_for(model)
    if fit is None or not probes:
        return budget, None
    room, reply = fit.feedback_room(probes, reply)
    if room < MIN_FEEDBACK_TOKENS:
        longest = max(probes, key=fit.limits.count)
        parts = {k: v for k, v in parts.items() if v}
        raise fit.too_long(what, parts, fit.reply(reply), request=longest)
    return (room if budget is None else min(budget, room)), fit.condense_tokens()
