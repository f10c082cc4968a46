"""``Optimizer``: parameter groups, ``zero_grad``, ``await step()``, state dicts."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from asyncgraph import Variable, enable_grad
from asyncgraph._exceptions import NoFeedbackWarning

__all__ = ["Closure", "Optimizer", "ParamGroup", "Params"]

Closure = Callable[[], Any | Awaitable[Any]]
"""What ``step(closure)`` takes: a sync or async function that computes the loss and runs
the backward (``zero_grad``, forward, ``await loss.backward()``) and returns the loss."""

ParamGroup = dict[str, Any]
Params = Iterable[Any]
"""Parameters (Variables) or parameter groups (dicts with a 'params' list), checked at run
time: a list of groups with different options infers as ``list[object]``, which a precise
union would reject."""


class Optimizer:
    """Base class of optimizers, shaped like ``torch.optim.Optimizer``.

    ``params`` is an iterable of Parameters (leaf Variables), or of dicts
    ``{"params": [...], **options}`` (parameter groups: each group's options
    override ``defaults``). ``param_groups`` holds the groups, ``state`` the
    per-parameter state (a dict per Parameter). ``await step(closure=None)``
    updates the parameters; like ``torch.optim``, an optional ``closure`` (sync or
    async) is called first, with grad enabled, to compute the loss and run the
    backward, and ``step`` returns what it returned. A parameter that received no
    gradient is not updated and draws a ``NoFeedbackWarning`` (once per step).
    Subclasses implement ``async step()`` and may convert their state to and from
    JSON-ready data with ``_state_to_data`` / ``_state_from_data``.

    ``state_dict()`` is JSON data that survives a round trip unchanged
    (``json.loads(json.dumps(d)) == d``): ``{"state": {"0": {...}}, "param_groups":
    [{**options, "params": [0, ...]}]}``, parameters numbered in group order as in
    PyTorch (state keys are those numbers as strings, as JSON objects need);
    parameter values are not included (they belong to the parameters).
    ``load_state_dict`` restores it into an optimizer built over the same
    parameters (int or str keys).

    Raises ``ValueError`` for a parameter given twice, a non-leaf parameter or an
    empty parameter list, ``TypeError`` for a non-Variable.

    Example::

        class Reset(Optimizer):  # puts every parameter that got feedback back to its first value
            def __init__(self, params):
                super().__init__(params, defaults={})
                self.first = {id(p): p.data for p in self.params}

            async def step(self, closure=None):
                loss = await self._run_closure(closure)
                for p in self.params:
                    if p.grad is not None:
                        p.data = self.first[id(p)]
                return loss
    """

    def __init__(self, params: Params, defaults: Mapping[str, Any]) -> None:
        self.defaults: dict[str, Any] = dict(defaults)
        self.warn_no_feedback = True
        self.warn_skipped = True  # ReplySkippedWarning; a job records skipped updates instead
        self.param_groups: list[ParamGroup] = []
        self.state: dict[Variable, dict[str, Any]] = {}
        if isinstance(params, Variable):
            raise TypeError(
                f"{type(self).__name__} expects an iterable of Parameters, got one Variable "
                f"({params!r}); wrap it in a list"
            )
        items = list(params)
        if not items:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        groups: list[Any] = [{"params": items}] if not isinstance(items[0], Mapping) else items
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group: Mapping[str, Any]) -> None:
        """Add a group ``{"params": [...], **options}``; missing options take the defaults."""
        if not isinstance(group, Mapping) or "params" not in group:
            raise TypeError(f"a parameter group is a dict with a 'params' list, got {group!r:.80}")
        raw = group["params"]
        params = [raw] if isinstance(raw, Variable) else list(raw)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(params):
            if not isinstance(p, Variable):
                raise TypeError(
                    f"{type(self).__name__} can only optimize Variables (Parameters); "
                    f"params[{i}] is {type(p).__name__} ({p!r:.60})"
                )
            if not p.is_leaf:
                raise ValueError(
                    f"{type(self).__name__} can't optimize a non-leaf Variable ({p!r}): it is "
                    f"computed by {p.grad_fn.name if p.grad_fn else '?'}; optimize the leaves"
                )
            if id(p) in seen:
                raise ValueError(
                    f"parameter {p!r} appears more than once in {type(self).__name__}'s groups"
                )
            seen.add(id(p))
        new: ParamGroup = {k: v for k, v in group.items() if k != "params"}
        for key, value in self.defaults.items():
            new.setdefault(key, copy.deepcopy(value))
        self._check_group(new)
        new["params"] = params
        self.param_groups.append(new)

    def _check_group(self, group: ParamGroup) -> None:
        """Validate a group's options (subclasses raise ValueError / TypeError)."""

    @property
    def params(self) -> list[Variable]:
        """Every parameter, in group order."""
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        """Forget every parameter's gradient (``.grad = None``), before the next backward."""
        for p in self.params:
            p.grad = None

    async def step(self, closure: Closure | None = None) -> Any:
        """Update the parameters from their gradients; returns ``closure``'s loss (or None).

        Subclasses implement it, starting with ``loss = await self._run_closure(closure)``
        and ending with ``return loss``, and call ``self._warn_no_feedback(params)`` with
        the parameters they skip for lack of a gradient.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement async step()")

    async def _run_closure(self, closure: Closure | None) -> Any:
        """``closure()`` (awaited if async) with grad enabled, as ``torch.optim`` does; its
        result is what ``step`` returns. None without a closure."""
        if closure is None:
            return None
        if not callable(closure):
            raise TypeError(
                f"{type(self).__name__}.step(closure): closure must be a function that "
                f"computes the loss and calls backward, got {closure!r:.80}"
            )
        with enable_grad():
            loss = closure()
            if inspect.isawaitable(loss):
                loss = await loss
        return loss

    def _warn_no_feedback(self, skipped: Iterable[Variable]) -> None:
        """One ``NoFeedbackWarning`` per parameter that got no gradient (``.grad is None``),
        unless ``warn_no_feedback`` is False (a job does the checking over its whole run)."""
        if not self.warn_no_feedback:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        for p in skipped:
            if p.grad is not None or not p.requires_grad:
                continue
            name = f"parameter {index.get(id(p), '?')}" + (f" ({p.role!r})" if p.role else "")
            warnings.warn(
                NoFeedbackWarning(
                    f"{type(self).__name__}.step(): {name} received no feedback in the last "
                    f"backward, so it was not updated. If it should have: check that it is "
                    f"used, with requires_grad=True and outside no_grad(), in computing the "
                    f"loss that backward ran from, and that zero_grad() did not run between "
                    f"backward and step"
                ),
                stacklevel=3,
            )

    # -- state ------------------------------------------------------------------
    def _state_to_data(self, param: Variable, state: dict[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(state)

    def _state_from_data(self, param: Variable, data: Mapping[str, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(data))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and options as JSON-ready data (see the class docstring)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = []
        for group in self.param_groups:
            options = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            options["params"] = [index[id(p)] for p in group["params"]]
            groups.append(options)
        state = {str(index[id(p)]): self._state_to_data(p, s) for p, s in self.state.items() if s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (also after a JSON round trip)."""
        groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state", {})
        if not isinstance(groups, list) or not isinstance(saved_state, Mapping):
            raise ValueError(
                "load_state_dict expects {'state': {...}, 'param_groups': [...]} as made by "
                "state_dict()"
            )
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state_dict has {len(groups)} parameter group(s), this optimizer "
                f"{len(self.param_groups)}"
            )
        for i, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved.get("params", ())) != len(group["params"]):
                raise ValueError(
                    f"parameter group {i} has {len(saved.get('params', ()))} parameter(s) in "
                    f"the state_dict and {len(group['params'])} in this optimizer"
                )
        params = self.params
        new_state: dict[Variable, dict[str, Any]] = {}
        for key, data in saved_state.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"state_dict state key {key!r} is not a parameter index") from None
            if not 0 <= i < len(params):
                raise ValueError(f"state_dict has state for parameter {i}; there are {len(params)}")
            new_state[params[i]] = self._state_from_data(params[i], data)
        for saved, group in zip(groups, self.param_groups, strict=True):
            options = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
            self._check_group(options)
            group.update(options)
        self.state = new_state

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            options = ", ".join(f"{k}={v!r}" for k, v in group.items() if k != "params")
            lines.append(f"  group {i}: {len(group['params'])} parameter(s), {options}")
        return "\n".join([*lines, ")"])
