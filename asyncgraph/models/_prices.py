"""Prices of common models, for models built from a spec without an explicit ``Pricing``.

A price here is a list price in US dollars per one million tokens (standard tier, no
batch discount), copied by hand from the provider's public price page, with the
provider's prompt-cache rates beside it: cached input (OpenAI's "cached input",
Anthropic's "cache hits") and, for Anthropic, cache writes (its 5-minute "cache
writes"; OpenAI does not bill writes). Prices change, so the table carries the date it
was read and its sources, and a model it does not name has no price (its cost shows as
"unknown", never as $0). Azure OpenAI deployments are named by their owner, so the
table never prices them: give ``pricing=`` or ``ASYNCGRAPH_MODEL_PRICES``. Overrides,
in order of precedence:

1. ``pricing=Pricing(...)`` given to the model or to ``parse_model_spec``;
2. ``ASYNCGRAPH_MODEL_PRICES``: ``"NAME=IN/OUT,NAME=IN/OUT/CACHED/WRITE"`` (dollars per
   million input / output / cached-input / cache-write tokens; the last two optional),
   e.g. ``"gpt-4o-mini=0.15/0.60/0.075,llama3=0/0"`` (``0/0`` for a model you run
   yourself and count as free); read when a model is built, so a worker fleet is priced
   by its environment;
3. this table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from asyncgraph._exceptions import ModelConfigError
from asyncgraph.models._usage import Pricing

__all__ = [
    "CONTEXT_WINDOWS",
    "CONTEXT_WINDOWS_DATE",
    "ENV_PRICES",
    "PRICES",
    "PRICES_DATE",
    "PRICES_SOURCE",
    "PRICE_SOURCES",
    "context_window",
    "default_pricing",
]

ENV_PRICES = "ASYNCGRAPH_MODEL_PRICES"

PRICES_DATE = "2025-08-07"
PRICE_SOURCES: Mapping[str, str] = {
    "openai": "https://openai.com/api/pricing/ (standard tier, per 1M tokens)",
    "anthropic": "https://docs.anthropic.com/en/docs/about-claude/pricing (per 1M tokens)",
}
PRICES_SOURCE = "; ".join(PRICE_SOURCES.values())

# name -> (input, output, cached input, cache write) US dollars per one million tokens,
# as of PRICES_DATE; None: the provider lists no such rate (billed as input).
_TABLE: dict[str, tuple[float, float, float | None, float | None]] = {
    # OpenAI: cached input listed per model; cache writes are not billed apart.
    "gpt-5": (1.25, 10.00, 0.125, None),
    "gpt-5-mini": (0.25, 2.00, 0.025, None),
    "gpt-5-nano": (0.05, 0.40, 0.005, None),
    "gpt-4.1": (2.00, 8.00, 0.50, None),
    "gpt-4.1-mini": (0.40, 1.60, 0.10, None),
    "gpt-4.1-nano": (0.10, 0.40, 0.025, None),
    "gpt-4o": (2.50, 10.00, 1.25, None),
    "gpt-4o-mini": (0.15, 0.60, 0.075, None),
    "o1": (15.00, 60.00, 7.50, None),
    "o3": (2.00, 8.00, 0.50, None),
    "o3-mini": (1.10, 4.40, 0.55, None),
    "o4-mini": (1.10, 4.40, 0.275, None),
    "gpt-4-turbo": (10.00, 30.00, None, None),
    "gpt-3.5-turbo": (0.50, 1.50, None, None),
    # Anthropic: cache hits at 0.1x input, 5-minute cache writes at 1.25x input.
    "claude-opus-4-1": (15.00, 75.00, 1.50, 18.75),
    "claude-opus-4": (15.00, 75.00, 1.50, 18.75),
    "claude-opus-4-0": (15.00, 75.00, 1.50, 18.75),
    "claude-sonnet-4": (3.00, 15.00, 0.30, 3.75),
    "claude-sonnet-4-0": (3.00, 15.00, 0.30, 3.75),
    "claude-3-7-sonnet": (3.00, 15.00, 0.30, 3.75),
    "claude-3-5-sonnet": (3.00, 15.00, 0.30, 3.75),
    "claude-3-5-haiku": (0.80, 4.00, 0.08, 1.00),
    "claude-3-haiku": (0.25, 1.25, 0.03, 0.30),
    "claude-3-opus": (15.00, 75.00, 1.50, 18.75),
}

PRICES: Mapping[str, Pricing] = {name: Pricing(*row) for name, row in _TABLE.items()}
"""The shipped price table (read on ``PRICES_DATE`` from ``PRICE_SOURCES``)."""

CONTEXT_WINDOWS_DATE = "2025-08-07"
# name -> context window in tokens (prompt and reply together), from the providers' model
# pages (the same sources as the prices) as of CONTEXT_WINDOWS_DATE.
CONTEXT_WINDOWS: Mapping[str, int] = {
    "gpt-5": 400_000,
    "gpt-5-mini": 400_000,
    "gpt-5-nano": 400_000,
    "gpt-4.1": 1_047_576,
    "gpt-4.1-mini": 1_047_576,
    "gpt-4.1-nano": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4o-mini": 128_000,
    "o1": 200_000,
    "o3": 200_000,
    "o3-mini": 200_000,
    "o4-mini": 200_000,
    "gpt-4-turbo": 128_000,
    "gpt-3.5-turbo": 16_385,
    "claude-opus-4-1": 200_000,
    "claude-opus-4": 200_000,
    "claude-opus-4-0": 200_000,
    "claude-sonnet-4": 200_000,
    "claude-sonnet-4-0": 200_000,
    "claude-3-7-sonnet": 200_000,
    "claude-3-5-sonnet": 200_000,
    "claude-3-5-haiku": 200_000,
    "claude-3-haiku": 200_000,
    "claude-3-opus": 200_000,
}
"""Context windows of the hosted models the price table names (``CONTEXT_WINDOWS_DATE``)."""

# A dated snapshot costs what its family name costs: OpenAI's "gpt-4o-mini-2024-07-18",
# Anthropic's "claude-sonnet-4-20250514", and Anthropic's moving "...-latest" aliases.
_SNAPSHOT = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|latest)$")
_NUMBER = r"([0-9.eE+-]+)"
_ENTRY = re.compile(
    rf"^\s*([^=,\s][^=,]*?)\s*=\s*{_NUMBER}\s*/\s*{_NUMBER}"
    rf"(?:\s*/\s*{_NUMBER})?(?:\s*/\s*{_NUMBER})?\s*$"
)


def _from_env(raw: str) -> dict[str, Pricing]:
    prices: dict[str, Pricing] = {}
    for entry in raw.split(","):
        if not entry.strip():
            continue
        match = _ENTRY.match(entry)
        try:
            if match is None:
                raise ValueError("not NAME=IN/OUT or NAME=IN/OUT/CACHED[/WRITE]")
            name, price_in, price_out, cached, write = match.groups()
            prices[name] = Pricing(
                float(price_in),
                float(price_out),
                None if cached is None else float(cached),
                None if write is None else float(write),
            )
        except ValueError as exc:
            raise ModelConfigError(
                f"{ENV_PRICES}: entry {entry.strip()!r} is not NAME=IN/OUT[/CACHED[/WRITE]] "
                f"with prices >= 0 in US dollars per million tokens ({exc}); e.g. "
                f"{ENV_PRICES}='gpt-4o-mini=0.15/0.60/0.075,my-model=0/0'",
                variable=ENV_PRICES,
                value=raw,
            ) from None
    return prices


def default_pricing(
    model: str, environ: Mapping[str, str] | None = None, *, table: bool = True
) -> Pricing | None:
    """The price of ``model``: from ``ASYNCGRAPH_MODEL_PRICES``, else the table (unless
    ``table=False``: an Azure deployment's name is its owner's), else None.

    A dated snapshot name (``gpt-4o-2024-08-06``, ``claude-sonnet-4-20250514``,
    ``claude-3-7-sonnet-latest``) falls back to its family (``gpt-4o``,
    ``claude-sonnet-4``, ``claude-3-7-sonnet``) in both. Raises ``ModelConfigError`` (a ``ValueError``) naming the
    variable when ``ASYNCGRAPH_MODEL_PRICES`` is malformed.
    """
    env = os.environ if environ is None else environ
    family = _SNAPSHOT.sub("", model)
    raw = env.get(ENV_PRICES, "")
    if raw.strip():
        overrides = _from_env(raw)
        for name in (model, family):
            if name in overrides:
                return overrides[name]
    for name in (model, family) if table else ():
        if name in PRICES:
            return PRICES[name]
    return None


def context_window(model: str) -> int | None:
    """The context window of a hosted ``model`` from ``CONTEXT_WINDOWS`` (a dated snapshot
    name falls back to its family, as prices do), or None.

    Example::

        context_window("gpt-4o-mini-2024-07-18")     # 128000
    """
    for name in (model, _SNAPSHOT.sub("", model)):
        if name in CONTEXT_WINDOWS:
            return CONTEXT_WINDOWS[name]
    return None
