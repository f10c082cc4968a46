"""Drafting a proposal: the reflective mutation of a parent.

The parent runs on a minibatch of the training set with grad; the losses of the examples
it scores below ``perfect_score`` are backpropagated (``await backward()``, on the
search's executor), and TGD rewrites every parameter from its ``.grad`` (with the
search's ``tgd_options``; its prompts and the parsing of its replies are TGD's). The
rewritten values are the child. No child comes of a parent perfect on its minibatch, of
a rewrite that cannot be read or of one that changed nothing; each says so in the
outcome's note. A child is kept for validation only if it scores better than its parent
on the same minibatch (``better_on_minibatch``).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgraph import Executor, backward, enable_grad, no_grad
from asyncgraph._exceptions import NoFeedbackWarning
from asyncgraph.models import ChatModel
from asyncgraph.optim._tgd import TGD, SkippedUpdate

from ._outcome import Outcome
from ._validation import Evaluator

__all__ = ["Draft", "Drafter"]


@dataclass
class Draft:
    """A proposal after its rewrite: the ``child``'s values and the parent's minibatch
    (``examples``) with its summed score there (``before``)."""

    outcome: Outcome
    child: dict[str, Any]
    examples: list[Mapping[str, Any]]
    before: float


@dataclass
class Drafter:
    """Drafts children of candidates from minibatches of ``train_set``; ``model()`` is the
    model that writes the rewrites (resolved when a rewrite is due)."""

    evaluator: Evaluator
    train_set: Sequence[Mapping[str, Any]]
    minibatch_size: int
    model: Callable[[], ChatModel]
    perfect_score: float
    tgd_options: Mapping[str, Any]
    executor: Executor | None
    skipped: list[SkippedUpdate] = field(default_factory=list)
    """The rewrites that could not be read (the search's ``skipped``)."""

    def minibatch(self, rng: random.Random) -> list[int]:
        """Positions of a minibatch of the training set, drawn by ``rng``."""
        return sorted(rng.sample(range(len(self.train_set)), self.minibatch_size))

    async def draft(
        self, values: dict[str, Any], batch: list[int], outcome: Outcome
    ) -> Draft | None:
        """The parent's forward on its minibatch ``batch``, the backward of its failures and
        the rewrite: the child's values (None, with a note, when there is no new child)."""
        program = self.evaluator.program(values)
        examples = [self.train_set[i] for i in batch]
        with enable_grad():
            results = await self.evaluator.run(program, examples)
        outcome.stages.append("forward")
        failing = [loss for loss, score in results if score < self.perfect_score]
        if not failing:
            outcome.note = "parent perfect on its minibatch"
            return None
        await backward(failing, executor=self.executor)
        outcome.stages.append("backward")
        tgd = TGD(program.parameters(), model=self.model(), **self.tgd_options)
        tgd.warn_skipped = False
        # tgd_options={"strict": True}: an unreadable rewrite raises UpdateParseError out
        # of the search's step, as TGD's step does.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoFeedbackWarning)
            await tgd.step()
        self.skipped.extend(tgd.skipped)
        outcome.stages.append("rewrite")
        child = program.state_dict()
        if child == values:
            unread = [s.role for s in tgd.skipped]
            outcome.note = (
                f"rewrite unreadable: {unread[0]!r}" if unread else "rewrite changed nothing"
            )
            return None
        return Draft(outcome, child, examples, sum(score for _, score in results))

    async def better_on_minibatch(self, draft: Draft) -> bool:
        """Whether the child scores more than its parent on the parent's minibatch (if
        not, a note says so)."""
        with no_grad():
            results = await self.evaluator.run(self.evaluator.program(draft.child), draft.examples)
        draft.outcome.stages.append("minibatch")
        after = sum(score for _, score in results)
        if after <= draft.before:
            draft.outcome.note = f"no better on its minibatch ({after:g} <= {draft.before:g})"
            return False
        return True
