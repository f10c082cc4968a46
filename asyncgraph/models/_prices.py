"""Prices of common models, for models built from a spec without an explicit ``Pricing``.

A price here is a list price in US dollars per one million tokens (standard tier, no
batch or cached-input discount), copied by hand from the provider's public price page:
prices change, so the table carries the date it was read, and a model it does not name
has no price (its cost shows as "unknown", never as $0). Overrides, in order of
precedence:

1. ``pricing=Pricing(...)`` given to the model or to ``parse_model_spec``;
2. ``ASYNCGRAPH_MODEL_PRICES``: ``"NAME=IN/OUT,NAME=IN/OUT"`` (dollars per million
   input / output tokens), e.g. ``"gpt-4o-mini=0.15/0.60,llama3=0/0"`` (``0/0`` for a
   model you run yourself and count as free); read when a model is built, so a worker
   fleet is priced by its environment;
3. this table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from asyncgraph._exceptions import ModelConfigError
from asyncgraph.models._usage import Pricing

__all__ = ["ENV_PRICES", "PRICES", "PRICES_DATE", "PRICES_SOURCE", "default_pricing"]

ENV_PRICES = "ASYNCGRAPH_MODEL_PRICES"

PRICES_DATE = "2025-08-07"
PRICES_SOURCE = "https://openai.com/api/pricing/ (standard tier, per 1M tokens)"

# name -> (input, output) US dollars per one million tokens, as of PRICES_DATE.
_TABLE: dict[str, tuple[float, float]] = {
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "o1": (15.00, 60.00),
    "o3": (2.00, 8.00),
    "o3-mini": (1.10, 4.40),
    "o4-mini": (1.10, 4.40),
    "gpt-4-turbo": (10.00, 30.00),
    "gpt-3.5-turbo": (0.50, 1.50),
}

PRICES: Mapping[str, Pricing] = {name: Pricing(i, o) for name, (i, o) in _TABLE.items()}
"""The shipped price table (read on ``PRICES_DATE`` from ``PRICES_SOURCE``)."""

# A dated snapshot ("gpt-4o-mini-2024-07-18") costs what its family name costs.
_SNAPSHOT = re.compile(r"-\d{4}-\d{2}-\d{2}$")
_ENTRY = re.compile(r"^\s*([^=,\s][^=,]*?)\s*=\s*([0-9.eE+-]+)\s*/\s*([0-9.eE+-]+)\s*$")


def _from_env(raw: str) -> dict[str, Pricing]:
    prices: dict[str, Pricing] = {}
    for entry in raw.split(","):
        if not entry.strip():
            continue
        match = _ENTRY.match(entry)
        try:
            if match is None:
                raise ValueError("not NAME=IN/OUT")
            name, price_in, price_out = match.groups()
            prices[name] = Pricing(float(price_in), float(price_out))
        except ValueError as exc:
            raise ModelConfigError(
                f"{ENV_PRICES}: entry {entry.strip()!r} is not NAME=IN/OUT with prices >= 0 in "
                f"US dollars per million tokens ({exc}); e.g. {ENV_PRICES}="
                f"'gpt-4o-mini=0.15/0.60,my-model=0/0'",
                variable=ENV_PRICES,
                value=raw,
            ) from None
    return prices


def default_pricing(model: str, environ: Mapping[str, str] | None = None) -> Pricing | None:
    """The price of ``model``: from ``ASYNCGRAPH_MODEL_PRICES``, else the table, else None.

    A dated snapshot name (``gpt-4o-2024-08-06``) falls back to its family
    (``gpt-4o``) in both. Raises ``ModelConfigError`` (a ``ValueError``) naming the
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
    for name in (model, family):
        if name in PRICES:
            return PRICES[name]
    return None
