"""What a search accepts: the checks of ``ParetoSearch``'s arguments, one message each,
and the model its ``model`` option names."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from asyncgraph import Module
from asyncgraph.models import ChatModel
from asyncgraph.text import feedback_defaults, resolve_model

from ._budget import Budget

__all__ = ["check_options", "feedback_model"]

COUNTS: dict[str, tuple[int, bool]] = {
    "proposals": (1, False),
    "merges": (0, False),
    "minibatch_size": (1, False),
    "val_size": (1, True),
    "max_frontier": (1, False),
    "max_concurrency": (1, False),
    "patience": (0, False),
}
"""The counts a search takes: the least each may be, and whether it may be None."""


def check_options(
    module: Any,
    train_set: Sequence[Any],
    val_set: Sequence[Any],
    *,
    budget: Budget,
    counts: Mapping[str, Any],
    model: Any,
) -> None:
    """``TypeError`` or ``ValueError`` for the first argument a search cannot take: the
    ``module`` (a Module with parameters), the data sets (not empty), the ``budget`` (at
    least one limit, each a positive count or number of dollars), the ``counts`` (see
    ``COUNTS``), the ``model`` (a ChatModel, a spec or None)."""
    if not isinstance(module, Module):
        raise TypeError(f"ParetoSearch searches a Module's parameters, got {module!r:.80}")
    if not list(module.named_parameters()):
        raise ValueError(f"ParetoSearch: {type(module).__name__} has no parameters")
    if not train_set or not val_set:
        raise ValueError("ParetoSearch needs a non-empty train_set and val_set")
    _check_budget(budget)
    for name, (minimum, allow_none) in COUNTS.items():
        _check_count(name, counts[name], allow_none=allow_none, minimum=minimum)
    if model is not None and not isinstance(model, (str, ChatModel)):
        raise TypeError(f"ParetoSearch: model must be a ChatModel or a spec, got {model!r}")


def feedback_model(model: str | ChatModel | None, base_url: str | None) -> ChatModel:
    """The model that writes the rewrites and merges: ``model`` (a spec is resolved at
    ``base_url``), or the default feedback model."""
    if model is None:
        model, base_url, _ = feedback_defaults("ParetoSearch", None, None)
    return resolve_model(model, base_url) if isinstance(model, str) else model


def _check_budget(budget: Budget) -> None:
    limits = (budget.max_calls, budget.max_tokens, budget.max_rounds, budget.max_cost_usd)
    if all(limit is None for limit in limits):
        raise ValueError(
            "ParetoSearch needs a budget: max_calls, max_tokens, max_cost_usd and/or max_rounds"
        )
    dollars = budget.max_cost_usd
    if dollars is not None and (
        isinstance(dollars, bool)
        or not isinstance(dollars, (int, float))
        or not 0 < dollars < math.inf
    ):
        raise ValueError(
            f"ParetoSearch: max_cost_usd must be a positive number of US dollars or None, "
            f"got {dollars!r}"
        )
    for name in ("max_calls", "max_tokens", "max_rounds"):
        _check_count(name, getattr(budget, name), allow_none=True)


def _check_count(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"ParetoSearch: {name} must be an int >= {minimum}"
            + (" or None" if allow_none else "")
            + f", got {value!r}"
        )
