"""Feedback budgets: feedback that never overflows a context window.

A text node's backward sends the feedback that reached it to its feedback model. When
one text feeds many consumers (a plan read by 200 judges), that feedback grows without
bound (TextGrad issues #93 and #179). Every text Function therefore has a **feedback
budget** in tokens (``approx_tokens``, 4 characters each): when the rendered feedback
reaching a node exceeds it, the node first condenses it by map-reduce through its
feedback model, then builds its backward requests from the condensed text, and the
gradients it sends on say that they were built from condensed feedback.

The budget of a call, first match wins: its ``feedback_budget=`` argument; the
innermost ``with use_feedback_budget(tokens)`` around it (a contextvar: per task, like
``no_grad``); ``set_feedback_budget(tokens)`` (the process default);
``DEFAULT_FEEDBACK_BUDGET``. ``None`` turns condensing off. It is read when the
Function is applied and stored in its node, so a worker uses the caller's budget.

The map-reduce (``condense_feedback``, shared with ``TGD``'s ``max_feedback_tokens``):
round 1 summarises consecutive chunks of feedback entries (each chunk within the budget;
an entry longer than the budget is split at whitespace, so nothing is dropped unread),
all chunks at once; later rounds summarise chunks of the previous round's summaries,
until one request holds everything. Chunks follow graph order, so the same feedback
gives the same requests in the same order on every run.

A model whose context window is known (``asyncgraph.text._fit``) lowers the budget to
what its window leaves for the feedback in each request (the other parts of the request
and room for the reply counted), and each summary request carries no more than the
window takes with its instruction and its reply: no request is refused for its size.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from asyncgraph.models import reply_tokens
from asyncgraph.text._concurrency import run_all
from asyncgraph.text._feedback import approx_tokens, feedback_entries, render_feedback
from asyncgraph.text._prompts import summary_messages
from asyncgraph.text._reply import summary_tokens

__all__ = [
    "DEFAULT_FEEDBACK_BUDGET",
    "condense_feedback",
    "truncate_to_tokens",
    "current_feedback_budget",
    "set_feedback_budget",
    "use_feedback_budget",
]

DEFAULT_FEEDBACK_BUDGET = 4000
"""Tokens of feedback a text node sends to its feedback model before it condenses."""

TRUNCATED = "\n[... feedback truncated to the feedback budget]"
_SUMMARY_TRUNCATED = "\n[... summary truncated]"
# The map-reduce merges up to this many chunk summaries per later request, and never
# runs more rounds than this (each round divides the feedback several times over).
_FAN_IN = 8
_MAX_ROUNDS = 16

Ask = Callable[[list[dict[str, Any]]], Awaitable[str]]
"""Sends one request (chat messages) to a model; returns the reply text."""

_UNSET: Any = object()
_process_budget: int | Any | None = _UNSET
_scoped_budget: contextvars.ContextVar[int | Any | None] = contextvars.ContextVar(
    "asyncgraph_feedback_budget", default=_UNSET
)


def _check_budget(tokens: Any, where: str) -> int | None:
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise TypeError(
            f"{where}: a feedback budget is an int >= 1 (tokens) or None (no condensing), "
            f"got {tokens!r}"
        )
    return tokens


@contextmanager
def use_feedback_budget(tokens: int | None) -> Iterator[None]:
    """Within the block (this task and the tasks it starts), text Functions applied
    without ``feedback_budget=`` use ``tokens`` (None: never condense).

    Example::

        with use_feedback_budget(1000):
            answer = await llm_call(prompt, question, model="simulated")
            loss = await TextLoss("Is it right?", model="simulated")(answer)
        await loss.backward()       # each node's feedback condensed to 1000 tokens
    """
    token = _scoped_budget.set(_check_budget(tokens, "use_feedback_budget"))
    try:
        yield
    finally:
        _scoped_budget.reset(token)


def set_feedback_budget(tokens: int | None) -> None:
    """The process default feedback budget (under any ``use_feedback_budget`` block).

    Example::

        set_feedback_budget(2000)     # condense a backward's feedback beyond 2000 tokens
        set_feedback_budget(None)     # never condense
    """
    global _process_budget
    _process_budget = _check_budget(tokens, "set_feedback_budget")


def current_feedback_budget(given: int | Any | None = _UNSET, *, where: str = "") -> int | None:
    """The budget in effect: ``given`` if passed, else the scoped, process or built-in one."""
    if given is not _UNSET:
        return _check_budget(given, where or "feedback_budget")
    scoped = _scoped_budget.get()
    if scoped is not _UNSET:
        return scoped
    if _process_budget is not _UNSET:
        return _process_budget
    return DEFAULT_FEEDBACK_BUDGET


def truncate_to_tokens(text: str, tokens: int, marker: str) -> str:
    """``text`` within ``tokens`` (``approx_tokens``), ending with ``marker`` if it was cut.

    Example::

        print(truncate_to_tokens("word " * 100, 10, " [cut]"))    # word word ... word [cut]
    """
    limit = tokens * 4
    if len(text) <= limit:
        return text
    if limit <= len(marker):
        return text[:limit]
    return text[: limit - len(marker)] + marker


def _split(text: str, tokens: int) -> list[str]:
    """``text`` in consecutive parts of at most ``tokens`` each, broken at whitespace when
    there is some in the second half of a part, so an over-long entry loses nothing."""
    limit = tokens * 4
    parts: list[str] = []
    while len(text) > limit:
        at = text.rfind(" ", limit // 2, limit + 1)
        at = max(at, text.rfind("\n", limit // 2, limit + 1))
        if at <= 0:
            at = limit
        parts.append(text[:at].rstrip())
        text = text[at:].lstrip()
    if text:
        parts.append(text)
    return parts


def _pack(pieces: list[str], tokens: int) -> list[list[str]]:
    """Consecutive pieces grouped so that each group, rendered, fits ``tokens``."""
    # Each piece costs its text plus at most its "--- feedback i of n ---" header and the
    # blank line between pieces; a group always takes at least one piece (which fits).
    header = len(f"--- feedback {len(pieces)} of {len(pieces)} ---\n\n\n")
    limit = tokens * 4
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for piece in pieces:
        cost = len(piece) + header
        if current and size + cost > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(piece)
        size += cost
    if current:
        chunks.append(current)
    return chunks


async def condense_feedback(
    entries: list[str],
    *,
    budget: int,
    role: str,
    ask: Ask,
    marker: str = TRUNCATED,
    chunk_tokens: int | None = None,
) -> str:
    """The feedback ``entries`` condensed into at most ``budget`` tokens by map-reduce.

    ``chunk_tokens``: the most feedback one summary request carries (default ``budget``),
    for a model whose context window takes less (see ``asyncgraph.text._fit``).

    Intermediate summaries are asked for (and cut to) a fraction of the budget small
    enough that every round shrinks the feedback several times over; the final one is
    cut to ``budget`` (ending with ``marker``) if the model wrote more. No entries give
    ``""`` without asking the model.

    Example::

        async def ask(messages):
            return (await model.complete(messages)).text

        short = await condense_feedback(
            feedback_entries(prompt.grad), budget=500, role="system prompt", ask=ask
        )
    """
    if not entries:
        return ""  # no feedback: nothing to condense, and no model call
    pack = budget if chunk_tokens is None else max(1, min(budget, chunk_tokens))
    pieces = [part for entry in entries for part in _split(entry, pack)]
    summaries = False
    previous_chunks: int | None = None
    for _ in range(_MAX_ROUNDS):
        chunks = _pack(pieces, pack)
        if len(chunks) == 1:
            return await _summarise(ask, role, chunks[0], budget, summaries, marker)
        if previous_chunks is not None and len(chunks) >= previous_chunks:
            break  # a budget too small for headers plus summaries: no progress left
        previous_chunks = len(chunks)
        target = max(1, budget // (2 * min(len(chunks), _FAN_IN)), min(budget // 4, 64))
        results = await _summarise_all(ask, role, chunks, target, summaries)
        pieces, summaries = results, True
    return truncate_to_tokens(render_feedback(pieces), budget, marker)


async def _summarise_all(
    ask: Ask, role: str, chunks: list[list[str]], target: int, summaries: bool
) -> list[str]:
    """Every chunk summarised (to ``target`` tokens), all requests at once."""
    results = [""] * len(chunks)

    async def one(i: int) -> None:
        results[i] = await _summarise(ask, role, chunks[i], target, summaries, _SUMMARY_TRUNCATED)

    await run_all([functools.partial(one, i) for i in range(len(chunks))])
    return results


async def _summarise(
    ask: Ask, role: str, chunk: list[str], target: int, summaries: bool, marker: str
) -> str:
    """One summary request for ``chunk``; the reply (or, if empty, the chunk) cut to ``target``."""
    text = render_feedback(chunk)
    messages = summary_messages(
        role=role, feedback=text, entries=len(chunk), max_tokens=target, summaries=summaries
    )
    with reply_tokens(summary_tokens(target)):
        reply = (await ask(messages)).strip()
    return truncate_to_tokens(reply or text, target, marker)


async def feedback_within_budget(
    grad: Any, *, budget: int | None, role: str, ask: Ask, chunk_tokens: int | None = None
) -> tuple[str, str | None]:
    """The feedback ``grad`` rendered for a backward request, and a note when condensed.

    Within ``budget`` (or with no budget) the rendered feedback is returned as is, with
    note None. Over it, the entries are condensed (``condense_feedback``) and the note
    says from how much to how much, for the gradients built from it.
    """
    feedback = render_feedback(grad)
    if budget is None or approx_tokens(feedback) <= budget:
        return feedback, None
    entries = feedback_entries(grad)
    condensed = await condense_feedback(
        entries, budget=budget, role=role, ask=ask, chunk_tokens=chunk_tokens
    )
    note = (
        f"[built from condensed feedback: {len(entries)} feedback entries "
        f"(about {approx_tokens(feedback)} tokens) were summarised to fit the feedback "
        f"budget of {budget} tokens]"
    )
    return condensed, note
