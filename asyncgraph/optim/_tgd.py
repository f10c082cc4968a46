"""``TGD``: textual gradient descent, one model call per parameter, all at once."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from asyncgraph import Variable
from asyncgraph._exceptions import UpdateParseError
from asyncgraph.models import BaseChatModel, ChatModel
from asyncgraph.optim._optimizer import Closure, Optimizer, ParamGroup, Params
from asyncgraph.optim._prompts import retry_message, update_messages
from asyncgraph.text import (
    approx_tokens,
    condense_feedback,
    current_models,
    describe,
    feedback_defaults,
    feedback_entries,
    render_feedback,
    resolve_model,
    run_all,
    truncate_to_tokens,
)

__all__ = ["TGD", "parse_tagged"]

DEFAULT_TAGS = ("<IMPROVED_VARIABLE>", "</IMPROVED_VARIABLE>")
_TRUNCATED = "\n[... feedback truncated to max_feedback_tokens]"
_PAST_TRUNCATED = "\n[... truncated to max_feedback_tokens]"


def parse_tagged(reply: str, open_tag: str, close_tag: str) -> str | None:
    """The text between the last ``close_tag`` of ``reply`` and the last ``open_tag`` before
    it, stripped; None if there is no such pair. Tags match case-insensitively.

    Anchoring on the last close tag makes a reply that first repeats the instructions
    ("Put it between <IMPROVED_VARIABLE> tags.") and then answers parse right.
    """
    closes = list(re.finditer(re.escape(close_tag), reply, re.IGNORECASE))
    if not closes:
        return None
    end = closes[-1].start()
    opens = list(re.finditer(re.escape(open_tag), reply[:end], re.IGNORECASE))
    if not opens:
        return None
    return reply[opens[-1].end() : end].strip()


def _examples(value: Any) -> list[str]:
    if isinstance(value, str) or not all(isinstance(item, str) for item in value):
        raise TypeError(
            f"TGD: in_context_examples must be a list of str, got {value!r:.80}"
            + ("; wrap it in a list" if isinstance(value, str) else "")
        )
    return list(value)


def _excerpt(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class TGD(Optimizer):
    """Textual gradient descent: rewrite each text parameter from its feedback.

    ``await tgd.step()`` sends, for every parameter with non-empty feedback
    (``render_feedback(p.grad)``; parameters without any are left alone), one
    request to ``model`` asking for an improved value between ``tags``
    (``<IMPROVED_VARIABLE>...</IMPROVED_VARIABLE>``), all parameters
    concurrently, then sets every ``p.data`` at once: if any update fails, no
    parameter changes.

    Options per parameter group (defaults here):

    - ``constraints``: texts the new value must satisfy, listed in the prompt;
    - ``momentum``: how many past steps (value before the step and the feedback
      it got) the prompt shows as memory; 0 = none. Kept in ``state`` as
      ``history`` (and ``step``, the number of updates), JSON-ready;
    - ``max_feedback_tokens`` (``B``; ``approx_tokens``: 4 characters per
      token): the guard that keeps every request within the model's context
      however many samples the feedback comes from. Feedback longer than ``B``
      is condensed by map-reduce: its entries are grouped into chunks of at most
      ``B`` tokens (an entry longer than ``B`` is split into parts), each chunk
      is summarised by one request, all chunks concurrently, then the summaries
      are grouped and summarised again, round after round, until one request
      condenses all that is left into at most ``B`` tokens (cut to ``B`` if the
      model writes more). No summary request holds more than ``B`` tokens of
      feedback (plus a fixed instruction of about 120 tokens and the role). The
      update prompt shows at most ``B`` tokens of feedback, and each past value
      and past feedback of the memory cut to ``B``: at most
      ``(2 * momentum + 1) * B`` tokens besides the current value and the
      constraints. None = no guard.

    ``model``: a ChatModel, a spec or a registered name (see
    ``asyncgraph.text.resolve_model``; ``base_url`` with a spec); not given: the
    default feedback model where ``step()`` runs (``asyncgraph.text.use_models``).
    ``model_params``: model parameters for every request (``{"temperature": 0}``);
    not given: the default feedback params.
    ``max_retries``: when a reply has no tagged value (or an empty one), the
    reply and a correction are sent back, up to this many extra times; then
    ``UpdateParseError`` names the parameter's role and shows the reply. A
    reply that cannot be parsed is never stored in (or replayed from) the
    model's response cache (``cache_if`` of a ``BaseChatModel``), so the next
    step asks the model again. ``system_prompt`` replaces the built-in one.
    ``in_context_examples``: texts shown in every update request as examples to
    follow (TextGrad's option): good values of the parameter, or of what it
    should produce; a parameter group may give its own (``{"params": [...],
    "in_context_examples": [...]}``). They are not cut to ``max_feedback_tokens``.
    Model errors propagate (``ModelError``).

    ``staged=True``: early, staged updates. Each parameter's update request starts
    inside ``backward``, the moment that parameter's feedback is final (a
    post-accumulate-grad hook, see ``Variable.register_post_accumulate_grad_hook``),
    while the rest of the backward still runs; the new value is staged, not
    applied. ``step()`` then applies the staged values of the parameters whose
    ``.grad`` is exactly the feedback the update was computed from (the pass
    succeeded and committed it) and updates any other parameter with feedback the
    usual way; a staged value from a failed pass is discarded, never applied. It
    stages only for a parameter whose ``.grad`` is None when its feedback arrives
    (``zero_grad()`` before each backward, as usual); an update error is raised by
    ``step()``, not by the backward. Backward plus step then takes about the
    critical path (the last parameter's feedback plus one update call) instead of
    the whole backward plus the slowest update.

    Example::

        tgd = TGD([prompt], model="openai:gpt-4o-mini", constraints=["Keep it under 50 words."])
        await loss.backward()
        await tgd.step()
        tgd.zero_grad()
    """

    def __init__(
        self,
        params: Params,
        model: str | ChatModel | None = None,
        *,
        base_url: str | None = None,
        constraints: Iterable[str] = (),
        momentum: int = 0,
        max_feedback_tokens: int | None = 4000,
        max_retries: int = 2,
        tags: tuple[str, str] = DEFAULT_TAGS,
        model_params: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        in_context_examples: Iterable[str] = (),
        staged: bool = False,
    ) -> None:
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"TGD: max_retries must be an int >= 0, got {max_retries!r}")
        if (
            not isinstance(tags, (tuple, list))
            or len(tags) != 2
            or not all(isinstance(t, str) and t for t in tags)
        ):
            raise ValueError(f"TGD: tags must be two non-empty strings (open, close), got {tags!r}")
        if model is not None and not isinstance(model, (str, ChatModel)):
            raise TypeError(f"TGD: model must be a ChatModel or a model spec, got {model!r:.80}")
        if isinstance(constraints, str):
            raise TypeError(
                f"TGD: constraints must be a list of str, got the str {constraints!r:.80}; "
                f"wrap it in a list"
            )
        self.in_context_examples = _examples(in_context_examples)
        self.model = model
        self.base_url = base_url
        self.max_retries = max_retries
        self.tags = (tags[0], tags[1])
        self.model_params = None if model_params is None else dict(model_params)
        self.system_prompt = system_prompt
        super().__init__(
            params,
            {
                "constraints": list(constraints),
                "momentum": momentum,
                "max_feedback_tokens": max_feedback_tokens,
            },
        )
        self.staged = bool(staged)
        # Parameter -> (the pass's gradient, the value it was computed for, the update
        # or the error it raised): filled by the hooks during backward, read by step().
        self._staged: dict[Variable, tuple[Variable, Any, tuple[str, str] | Exception]] = {}
        self._hook_handles = (
            [p.register_post_accumulate_grad_hook(self._early_update) for p in self.params]
            if self.staged
            else []
        )

    def _check_group(self, group: ParamGroup) -> None:
        constraints = group.get("constraints", [])
        if isinstance(constraints, str) or not all(isinstance(c, str) for c in constraints):
            raise TypeError(f"TGD: constraints must be a list of str, got {constraints!r:.80}")
        group["constraints"] = list(constraints)
        if "in_context_examples" in group:  # a group's own examples (else the optimizer's)
            group["in_context_examples"] = _examples(group["in_context_examples"])
        momentum = group.get("momentum", 0)
        if not isinstance(momentum, int) or isinstance(momentum, bool) or momentum < 0:
            raise ValueError(f"TGD: momentum must be an int >= 0 (past steps), got {momentum!r}")
        budget = group.get("max_feedback_tokens")
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
        ):
            raise ValueError(
                f"TGD: max_feedback_tokens must be an int >= 1 or None, got {budget!r}"
            )

    def _model(self) -> ChatModel:
        model, base_url = self.model, self.base_url
        if model is None:  # the default feedback model (see use_models), read at step time
            model, base_url, _ = feedback_defaults("TGD", None, None)
        if isinstance(model, str):
            return resolve_model(model, base_url)
        return model

    async def _ask(
        self, model: ChatModel, messages: list[dict[str, Any]], usable: Callable[[str], bool]
    ) -> str:
        """One request; a reply that is not ``usable`` is kept out of the response cache."""
        params = self.model_params
        if params is None:  # the default feedback params (see use_models)
            params = current_models().for_feedback()[2]
        if isinstance(model, BaseChatModel):
            completion = await model.complete(messages, cache_if=lambda c: usable(c.text), **params)
        else:
            completion = await model.complete(messages, **params)
        return completion.text

    def _jobs(self) -> list[tuple[Variable, ParamGroup, list[str]]]:
        """Every parameter with feedback, its group and its feedback entries."""
        jobs: list[tuple[Variable, ParamGroup, list[str]]] = []
        for group in self.param_groups:
            for p in group["params"]:
                entries = feedback_entries(p.grad)
                if not entries:
                    continue
                if not isinstance(p.data, str):
                    raise TypeError(
                        f"TGD updates text parameters; parameter {p.role!r} holds "
                        f"{type(p.data).__name__} ({p.data!r:.60}). Use SGD for numbers."
                    )
                jobs.append((p, group, entries))
        return jobs

    def _group_of(self, p: Variable) -> ParamGroup | None:
        return next((g for g in self.param_groups if any(q is p for q in g["params"])), None)

    async def _early_update(self, p: Variable, grad: Variable) -> None:
        """``staged=True``: compute ``p``'s update inside the backward (see the class doc)."""
        self._staged.pop(p, None)
        group = self._group_of(p)
        if group is None or p.grad is not None or not isinstance(p.data, str):
            return  # accumulating onto an older gradient, or not ours to stage: step() does it
        entries = feedback_entries(grad)
        if not entries:
            return
        value = p.data
        outcome: tuple[str, str] | Exception
        try:
            outcome = await self._update(self._model(), p, group, entries)
        except Exception as exc:  # raised by step(), which is where an update fails
            outcome = exc
        self._staged[p] = (grad, value, outcome)

    def remove_hooks(self) -> None:
        """``staged=True``: unregister the hooks from the parameters (staging stops)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._staged.clear()

    async def step(self, closure: Closure | None = None) -> Any:
        """Update every parameter that has feedback; see the class docstring.

        ``closure``: see ``Optimizer.step``; its loss is returned (None without one).
        """
        loss = await self._run_closure(closure)
        self._warn_no_feedback(self.params)
        jobs = self._jobs()
        staged, self._staged = self._staged, {}
        if not jobs:
            return loss
        results: list[tuple[str, str] | None] = [None] * len(jobs)
        pending: list[int] = []
        for i, (p, _, _) in enumerate(jobs):
            early = staged.get(p)
            # Staged by this pass's hook: .grad is the very gradient it saw (committed, so
            # the pass succeeded) and the value is still the one it rewrote.
            if early is not None and early[0] is p.grad and early[1] == p.data:
                if isinstance(early[2], Exception):
                    raise early[2]
                results[i] = early[2]
            else:
                pending.append(i)
        if pending:
            model = self._model()

            async def update(i: int) -> None:
                p, group, entries = jobs[i]
                results[i] = await self._update(model, p, group, entries)

            await run_all([functools.partial(update, i) for i in pending])
        for (p, group, _), result in zip(jobs, results, strict=True):
            assert result is not None
            new_value, used_feedback = result
            state = self.state.setdefault(p, {})
            state["step"] = int(state.get("step", 0)) + 1
            momentum = group["momentum"]
            if momentum > 0:
                history = state.setdefault("history", [])
                history.append({"value": p.data, "feedback": used_feedback})
                del history[:-momentum]
            p.data = new_value
        return loss

    async def _update(
        self, model: ChatModel, p: Variable, group: ParamGroup, entries: list[str]
    ) -> tuple[str, str]:
        """The new value of ``p`` and the feedback it was computed from (after the guard)."""
        role = describe(p.role, "variable")
        budget: int | None = group["max_feedback_tokens"]
        feedback = render_feedback(entries)
        if budget is not None and approx_tokens(feedback) > budget:
            feedback = await self._condense(model, role, entries, budget)
        momentum = group["momentum"]
        history: list[dict[str, Any]] = list(self.state.get(p, {}).get("history", []))
        history = history[-momentum:] if momentum > 0 else []
        if budget is not None:
            history = [
                {
                    "value": truncate_to_tokens(
                        str(item.get("value", "")), budget, _PAST_TRUNCATED
                    ),
                    "feedback": truncate_to_tokens(
                        str(item.get("feedback", "")), budget, _PAST_TRUNCATED
                    ),
                }
                for item in history
            ]
        open_tag, close_tag = self.tags
        messages = update_messages(
            role=role,
            value=p.data,
            feedback=feedback,
            history=history,
            constraints=group["constraints"],
            open_tag=open_tag,
            close_tag=close_tag,
            system_prompt=self.system_prompt,
            examples=group.get("in_context_examples", self.in_context_examples),
        )

        def parses(reply: str) -> bool:
            return bool(parse_tagged(reply, open_tag, close_tag))

        attempts = self.max_retries + 1
        reply = ""
        for _ in range(attempts):
            reply = await self._ask(model, messages, parses)
            value = parse_tagged(reply, open_tag, close_tag)
            if value:
                return value, feedback
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                retry_message(role, open_tag, close_tag, empty=value is not None),
            ]
        raise UpdateParseError(
            f"TGD could not read an improved value for the parameter with role {p.role!r}: "
            f"after {attempts} attempt(s) the model's reply has no non-empty "
            f"{open_tag}...{close_tag} span. Last reply ({len(reply)} chars): "
            f"{_excerpt(reply)!r}. The model must put the new value between these tags: check "
            f"that it follows the optimizer's prompt, raise max_retries, or pass the tags it "
            f"uses as tags=(open, close). No parameter was changed.",
            role=p.role,
            attempts=attempts,
            reply=reply,
        )

    async def _condense(self, model: ChatModel, role: str, entries: list[str], budget: int) -> str:
        """The feedback ``entries`` condensed into at most ``budget`` tokens (map-reduce:
        ``asyncgraph.text.condense_feedback``, the one every text node's budget uses)."""

        async def ask(messages: list[dict[str, Any]]) -> str:
            return await self._ask(model, messages, lambda reply: bool(reply.strip()))

        return await condense_feedback(
            entries, budget=budget, role=role, ask=ask, marker=_TRUNCATED
        )
