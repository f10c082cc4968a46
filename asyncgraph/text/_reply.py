"""How long a reply asyncgraph asks for, by what it asks: one table.

Each request the text Functions and the optimizers send suggests its reply's size to the
model (``asyncgraph.models.reply_tokens``): a model that has a ``max_tokens`` of its own,
or a call that gives one in its params, wins over these. A small local model rambles up
to its context's end when nothing bounds it, and a server's slot is busy all that time.
"""

from __future__ import annotations

from asyncgraph.text._feedback import approx_tokens

__all__ = [
    "ANSWER_TOKENS",
    "FEEDBACK_TOKENS",
    "VERDICT_TOKENS",
    "summary_tokens",
    "update_tokens",
]

ANSWER_TOKENS = 1024
"""An LLM call's answer (its forward)."""
VERDICT_TOKENS = 512
"""A judge's verdict (``TextLoss``)."""
FEEDBACK_TOKENS = 768
"""One feedback request of a backward."""


def summary_tokens(target: int) -> int:
    """A summary asked to be at most ``target`` tokens (``approx_tokens``), with room for
    a tokenizer that counts more tokens than ``approx_tokens`` does."""
    return target + target // 2 + 32


def update_tokens(value: str) -> int:
    """An optimizer's rewrite of ``value``: room for twice its length and a margin (in
    JSON, with its quoting), between 256 and 8,192 tokens."""
    return max(256, min(8192, 2 * approx_tokens(value) + 256))
