"""What a job has spent, and the cost cap (``Job.max_cost_usd``).

Totals are running sums over every model call the job made, the initial validation's
included, across resumes: what the checkpoint says was spent (``spent``: the calls of a
step that was cut and rolled back included, since they were paid; in older checkpoints,
the last history row, or the initial validation's usage), plus this process's calls.

The cap is kept two ways:

- at each step boundary, the next step is estimated at the dearest step so far (with
  a validation when one is due: the dearest validation so far); when the spend plus
  that estimate would pass the cap, the job stops before the step, with the checkpoint
  of the last whole step;
- a step that passes the cap anyway (an estimate is not a bound) stops sending calls as
  it passes (``UsageMeter.stop_sending``: the calls not yet sent wait), lets the calls
  already sent finish and counts them (each within its own timeout, all within
  ``DRAIN_S``), then is stopped, cleanly, as Ctrl-C stops one: it is rolled back to the
  checkpoint of the last whole step, and a resume with a higher cap redoes it (its calls
  are paid twice, and counted twice: the totals, and the estimate of the step after a
  resume, include them). Remote tasks the stop cancels are counted too: a worker reports
  what the calls of a cancelled task spent (NOTE [One meter] in ``asyncgraph.models``).

Every call sent is counted, finished or cut (a step cut by Ctrl-C or an error, a call
still out after ``DRAIN_S``): a call cut before its answer came back is counted at an
upper bound of its cost, and the totals say so (``cut_calls``: the cost is then an
upper bound, labelled as one wherever it is shown). A step that fails keeps its calls
in the totals, as a cut one does.

A cap needs prices. Before its first call (before the initial validation), a capped job
looks for the models it can reach without running anything (``_reachable``: the
optimizer's, the Module's, those the ``forward`` refers to, the default models) and
raises ``ModelConfigError`` naming any without a ``Pricing`` (``check_priced``). A model
that cannot be seen up front (built or named while the job runs) is caught at its first
call instead: an unpriced call stops the job with the same error, before it can spend
an unknown amount.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from asyncgraph._exceptions import ModelConfigError
from asyncgraph.models import BaseChatModel, Usage, UsageMeter

from ._reachable import reachable_models

__all__ = ["Spending", "check_priced"]

POLL_S = 0.05  # how often a running step's spend is compared with the cap
DRAIN_S = 600.0  # how long a job past its cap waits for the calls in flight, at most


_HOW_TO_PRICE = (
    "give the model a Pricing (e.g. OpenAIChat(..., pricing=Pricing(0.15, 0.60)), or "
    "ASYNCGRAPH_MODEL_PRICES for a model built from a spec), or run without a cap"
)


def check_priced(name: str, cap: float, optimizer: Any, parameters: Any, forward: Any) -> None:
    """Raise ``ModelConfigError`` when a model the job ``name`` can reach (see
    ``_reachable``) has no price, so that a cost cap of ``cap`` could not count its calls.

    Names each such model and where it was found. A model that is not a
    ``BaseChatModel`` counts as unpriced: its calls are not metered at all.
    """
    unpriced = []
    for found in reachable_models(optimizer, parameters, forward):
        model = found.model
        shown = type(model).__name__ + ("" if found.name is None else f" {found.name!r}")
        if not isinstance(model, BaseChatModel):
            unpriced.append(f"{shown} at {found.where} (not a BaseChatModel: calls not metered)")
        elif model.pricing is None:
            unpriced.append(f"{shown} at {found.where}")
    if unpriced:
        raise ModelConfigError(
            f"job {name!r} can call a model without a price, and a cost cap "
            f"(max_cost_usd={cap:g}) needs every call priced: {'; '.join(unpriced)}. "
            f"{_HOW_TO_PRICE[0].upper()}{_HOW_TO_PRICE[1:]}",
            variable="pricing",
            value="None",
        )


class Spending:
    """The job's running totals and its cap; ``meter`` counts this process's calls.

    ``meter`` is a ``UsageMeter`` that checks the cap on every call it records: a call
    that passes the cap stops the sending of calls at once, and the job once no call is
    in flight (at once, on the event loop's thread: async model clients, remote usage;
    else, and after ``DRAIN_S`` at most, by ``watch``).
    """

    def __init__(
        self, cap: float | None, before: Mapping[str, Any], stop: anyio.CancelScope
    ) -> None:
        self.cap = cap
        self.meter = _CheckingMeter(self._check)
        self._stop = stop
        self._loop_thread = threading.get_ident()
        self.before_tokens = int(before.get("tokens", 0))
        self.before_cost = float(before.get("cost_usd", 0.0))
        self.before_unpriced = int(before.get("unpriced_calls", 0))
        self.before_replayed = int(before.get("replayed_calls", 0))
        self.before_cut = int(before.get("cut_calls", 0))
        self.capped = False
        """True once the job stopped (or must stop) at the cap."""
        self.error: ModelConfigError | None = None
        """Set when an unpriced call stopped a capped job."""

    def totals(self) -> dict[str, Any]:
        """The running totals of a history row: ``tokens``, ``cost_usd``, ``unpriced_calls``,
        ``replayed_calls`` (calls a rerun remote task replayed instead of paying again) and
        ``cut_calls`` (calls cut before their answer: if any, the cost is an upper bound)."""
        spent = self.meter.snapshot()
        return {
            "tokens": self.before_tokens + spent.total_tokens,
            "cost_usd": self.before_cost + spent.cost_usd,
            "unpriced_calls": self.before_unpriced + spent.unpriced_requests,
            "replayed_calls": self.before_replayed + spent.replayed,
            "cut_calls": self.before_cut + spent.cut,
        }

    def next_step_fits(
        self, history: Sequence[Mapping[str, Any]], start_cost: float, validating: bool
    ) -> bool:
        """Whether a step more (``validating``: with a validation) is expected to stay
        within the cap; False also sets ``capped``. Always True without a cap, or before
        any step (nothing to estimate from). ``start_cost``: the spend before the first
        step (the initial validation's)."""
        if self.cap is None:
            return True
        estimate = step_estimate(history, start_cost, validating)
        if estimate is None:
            return True
        if self.totals()["cost_usd"] + estimate > self.cap:
            self.capped = True
        return not self.capped

    async def watch(self) -> None:
        """While a job runs: once its spend passed the cap (or a call was unpriced), wait
        for the calls in flight to end (``DRAIN_S`` at most), then stop the job. For what
        ``_check`` cannot do at once: calls recorded off the event loop's thread, calls
        still in flight when the cap was passed."""
        if self.cap is None:
            return
        # Polls, not events: another thread may not set an anyio.Event either.
        while not self._check():  # noqa: ASYNC110
            await anyio.sleep(POLL_S)
        with anyio.move_on_after(DRAIN_S):
            while self.meter.in_flight > 0:  # noqa: ASYNC110
                await anyio.sleep(POLL_S)
        self._stop.cancel()

    def _check(self) -> bool:
        """Stop sending calls if the job's spend passed the cap or a call was unpriced, and
        the job too if no call is in flight (on the event loop's thread); True if so."""
        if self.cap is None:
            return False
        if self.error is None and not self.capped:
            totals = self.totals()
            if totals["unpriced_calls"] > self.before_unpriced:
                self.error = ModelConfigError(
                    f"a model without a price answered a call of this job, and a cost cap "
                    f"(max_cost_usd={self.cap:g}) needs every call priced: {_HOW_TO_PRICE}",
                    variable="pricing",
                    value="None",
                )
                self.meter.stop_sending("a model without a price answered a call of the job")
            elif totals["cost_usd"] > self.cap:
                self.capped = True
                self.meter.stop_sending(f"the job passed its cost cap (max_cost_usd={self.cap:g})")
        stopped = self.error is not None or self.capped
        if stopped and self.meter.in_flight == 0 and threading.get_ident() == self._loop_thread:
            self._stop.cancel()
        return stopped


class _CheckingMeter(UsageMeter):
    """A ``UsageMeter`` that calls ``check`` after recording each call, and as each call
    in flight ends."""

    def __init__(self, check: Any) -> None:
        super().__init__()
        self._check = check

    def record_completion(self, *args: Any, **kwargs: Any) -> None:
        super().record_completion(*args, **kwargs)
        self._check()

    def record_cut(self, *args: Any, **kwargs: Any) -> None:
        super().record_cut(*args, **kwargs)
        self._check()

    def add(self, usage: Usage) -> None:
        super().add(usage)
        self._check()

    def call_ended(self) -> None:
        super().call_ended()
        self._check()


def step_estimate(
    history: Sequence[Mapping[str, Any]], start_cost: float, validating: bool
) -> float | None:
    """The cost of the next step: the dearest step so far, with or without a validation
    as the next one has it (any step when no step like it ran yet); None before any."""
    costs: list[tuple[float, bool]] = []
    previous = start_cost
    for row in history:
        cost = float(row["cost_usd"])
        costs.append((cost - previous, row.get("val_score") is not None))
        previous = cost
    if not costs:
        return None
    alike = [cost for cost, validated in costs if validated == validating]
    return max(alike or [cost for cost, _ in costs])
