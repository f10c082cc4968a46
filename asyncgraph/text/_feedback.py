"""Textual gradients as data: entries in graph order, rendered as one text.

The gradient of a text variable is a string (one piece of feedback) or a list
of strings (feedback from several paths, summed in graph order by
the core's ``accumulate``, ``asyncgraph/_core/_accumulate.py``). ``""`` means "no specific feedback" (the implicit
gradient of a text loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from asyncgraph import Variable

__all__ = ["approx_tokens", "feedback_entries", "render_feedback"]


def feedback_entries(grad: Variable | str | Sequence[Any] | None) -> list[str]:
    """The non-empty feedback entries of a gradient, in graph order.

    Accepts a gradient Variable (``var.grad``), its data (a string or a list of
    strings) or None. Empty entries (``""``, "no specific feedback") are
    dropped; other data is converted with ``str()``. Entries are stripped of
    surrounding whitespace.

    Example::

        await loss.backward()
        for entry in feedback_entries(prompt.grad):
            print("-", entry)
        print(feedback_entries(["too long ", "", " vague"]))    # ['too long', 'vague']
    """
    data: Any = grad.data if isinstance(grad, Variable) else grad
    if data is None:
        return []
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    entries: list[str] = []
    for item in items:
        if item is None:
            continue
        text = (item if isinstance(item, str) else str(item)).strip()
        if text:
            entries.append(text)
    return entries


def render_feedback(grad: Variable | str | Sequence[Any] | None) -> str:
    """A gradient as one text: each feedback entry once, in graph order.

    One entry is returned as is; several are numbered and separated::

        --- feedback 1 of 2 ---
        The answer skips the units.

        --- feedback 2 of 2 ---
        The answer is too long.

    No feedback (None, ``""`` or only empty entries) renders as ``""``.

    Example::

        await loss.backward()
        print(render_feedback(system_prompt.grad))
    """
    entries = feedback_entries(grad)
    if len(entries) <= 1:
        return entries[0] if entries else ""
    n = len(entries)
    return "\n\n".join(f"--- feedback {i} of {n} ---\n{text}" for i, text in enumerate(entries, 1))


def approx_tokens(text: str) -> int:
    """Approximate token count of ``text``: one token per 4 characters, rounded up.

    The usual rule of thumb for English with GPT-style tokenizers (the models'
    rate limiter estimates the same way). It needs no tokenizer and is
    deterministic; it overestimates for plain prose, underestimates for dense
    code or non-Latin scripts, so leave some margin below a context window.

    Example::

        print(approx_tokens("abcdefghi"))     # 3
    """
    return math.ceil(len(text) / 4)
