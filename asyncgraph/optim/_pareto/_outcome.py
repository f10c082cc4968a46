"""What one work item of a round produced and what it cost.

Every part of a round writes into its item's ``Outcome``: drafting and merging the model
calls they made (``stages``) and why no child came of them (``note``), validation the
child and its scores; the round adds what the item spent (``charge``). The history shows
each outcome as one row (``to_row``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgraph.models import Usage

__all__ = ["Cost", "Outcome"]

Cost = tuple[int, int, float]
"""Model calls, tokens and US dollars."""


@dataclass
class Outcome:
    """One work item of a round: its ``kind`` (``"seed"``, ``"proposal"``, ``"merge"`` or
    ``"validation"``) and ``parents``; the ``child`` it produced and its ``scores`` on the
    Pareto set (both None when nothing is kept), the model-call phases it went through
    (``stages``), a ``note`` for the history and what it ``cost``."""

    kind: str
    parents: tuple[int, ...]
    child: dict[str, Any] | None = None
    scores: list[float] | None = None
    stages: list[str] = field(default_factory=list)
    note: str = ""
    cost: Cost = (0, 0, 0.0)
    improved: bool = False
    """A greedy proposal whose child beat its parent on the minibatch."""

    def charge(self, spent: Usage) -> None:
        """Add what a part of the item spent (a ``track_usage`` snapshot) to its cost."""
        calls, tokens, dollars = self.cost
        self.cost = (
            calls + spent.requests,
            tokens + spent.total_tokens,
            dollars + spent.cost_usd,
        )

    def to_row(self) -> dict[str, Any]:
        """The item as the history shows it (one entry of a round's ``work``)."""
        return {
            "kind": self.kind,
            "parents": list(self.parents),
            "stages": self.stages,
            "note": self.note,
            "calls": self.cost[0],
            "tokens": self.cost[1],
            "cost_usd": self.cost[2],
        }
