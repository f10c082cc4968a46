"""``TGD``: textual gradient descent, one model call per parameter, all at once."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from asyncgraph._variable import Variable
from asyncgraph.models import ChatModel
from asyncgraph.optim._exceptions import UpdateParseError
from asyncgraph.optim._optimizer import Optimizer, ParamGroup, Params
from asyncgraph.optim._prompts import retry_message, summary_messages, update_messages
from asyncgraph.text._concurrency import run_all
from asyncgraph.text._feedback import approx_tokens, feedback_entries, render_feedback
from asyncgraph.text._prompts import describe
from asyncgraph.text._registry import ModelLike, resolve_model

__all__ = ["TGD", "parse_tagged"]

DEFAULT_TAGS = ("<IMPROVED_VARIABLE>", "</IMPROVED_VARIABLE>")
_TRUNCATED = "\n[... feedback truncated to max_feedback_tokens]"


def parse_tagged(reply: str, open_tag: str, close_tag: str) -> str | None:
    """The text of the last ``open_tag ... close_tag`` span of ``reply``, stripped; None if none.

    The last span wins, so a reply that first repeats the instructions ("between
    <IMPROVED_VARIABLE> and </IMPROVED_VARIABLE>") and then answers parses right.
    """
    spans = re.findall(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), reply, re.DOTALL)
    return spans[-1].strip() if spans else None


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
    - ``max_feedback_tokens``: feedback longer than this (``approx_tokens``:
      4 characters per token) is first condensed by one extra model call
      (several sources' feedback in one summary), and cut to the budget if the
      summary is still too long, so a batch of hundreds of samples never
      overflows the model's context. The prompt then holds at most
      ``(momentum + 1) * max_feedback_tokens`` tokens of feedback. None = no
      guard.

    ``model``: a ChatModel, a spec or a registered name (see
    ``asyncgraph.text.resolve_model``; ``base_url`` with a spec).
    ``model_params``: model parameters for every request (``{"temperature": 0}``). ``max_retries``: when a reply has no
    tagged value (or an empty one), the reply and a correction are sent back,
    up to this many extra times; then ``UpdateParseError`` names the parameter's
    role and shows the reply. ``system_prompt`` replaces the built-in one.
    Model errors propagate (``ModelError``).

    Example::

        tgd = TGD([prompt], model="openai:gpt-4o-mini", constraints=["Keep it under 50 words."])
        await loss.backward()
        await tgd.step()
        tgd.zero_grad()
    """

    def __init__(
        self,
        params: Params,
        model: ModelLike,
        *,
        base_url: str | None = None,
        constraints: Iterable[str] = (),
        momentum: int = 0,
        max_feedback_tokens: int | None = 4000,
        max_retries: int = 2,
        tags: tuple[str, str] = DEFAULT_TAGS,
        model_params: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"TGD: max_retries must be an int >= 0, got {max_retries!r}")
        if (
            not isinstance(tags, (tuple, list))
            or len(tags) != 2
            or not all(isinstance(t, str) and t for t in tags)
        ):
            raise ValueError(f"TGD: tags must be two non-empty strings (open, close), got {tags!r}")
        if not isinstance(model, str) and not isinstance(model, ChatModel):
            raise TypeError(f"TGD: model must be a ChatModel or a model spec, got {model!r:.80}")
        if isinstance(constraints, str):
            raise TypeError(
                f"TGD: constraints must be a list of str, got the str {constraints!r:.80}; "
                f"wrap it in a list"
            )
        self.model = model
        self.base_url = base_url
        self.max_retries = max_retries
        self.tags = (tags[0], tags[1])
        self.model_params = dict(model_params or {})
        self.system_prompt = system_prompt
        super().__init__(
            params,
            {
                "constraints": list(constraints),
                "momentum": momentum,
                "max_feedback_tokens": max_feedback_tokens,
            },
        )

    def _check_group(self, group: ParamGroup) -> None:
        constraints = group.get("constraints", [])
        if isinstance(constraints, str) or not all(isinstance(c, str) for c in constraints):
            raise TypeError(f"TGD: constraints must be a list of str, got {constraints!r:.80}")
        group["constraints"] = list(constraints)
        momentum = group.get("momentum", 0)
        if not isinstance(momentum, int) or isinstance(momentum, bool) or momentum < 0:
            raise ValueError(f"TGD: momentum must be an int >= 0 (past steps), got {momentum!r}")
        budget = group.get("max_feedback_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"TGD: max_feedback_tokens must be an int >= 1 or None, got {budget!r}")

    def _model(self) -> ChatModel:
        if isinstance(self.model, str):
            return resolve_model(self.model, self.base_url)
        return self.model

    async def step(self) -> None:
        """Update every parameter that has feedback; see the class docstring."""
        jobs: list[tuple[Variable, ParamGroup, str]] = []
        for group in self.param_groups:
            for p in group["params"]:
                feedback = render_feedback(p.grad)
                if not feedback:
                    continue
                if not isinstance(p.data, str):
                    raise TypeError(
                        f"TGD updates text parameters; parameter {p.role!r} holds "
                        f"{type(p.data).__name__} ({p.data!r:.60}). Use SGD for numbers."
                    )
                jobs.append((p, group, feedback))
        if not jobs:
            return
        model = self._model()
        results: list[tuple[str, str] | None] = [None] * len(jobs)

        async def update(i: int) -> None:
            p, group, feedback = jobs[i]
            results[i] = await self._update(model, p, group, feedback)

        await run_all([functools.partial(update, i) for i in range(len(jobs))])
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

    async def _update(
        self, model: ChatModel, p: Variable, group: ParamGroup, feedback: str
    ) -> tuple[str, str]:
        """The new value of ``p`` and the feedback it was computed from (after the guard)."""
        role = describe(p.role, "variable")
        budget = group["max_feedback_tokens"]
        if budget is not None and approx_tokens(feedback) > budget:
            feedback = await self._condense(model, role, feedback, len(feedback_entries(p.grad)), budget)
        history: Sequence[dict[str, Any]] = self.state.get(p, {}).get("history", [])
        momentum = group["momentum"]
        open_tag, close_tag = self.tags
        messages = update_messages(
            role=role,
            value=p.data,
            feedback=feedback,
            history=history[-momentum:] if momentum > 0 else [],
            constraints=group["constraints"],
            open_tag=open_tag,
            close_tag=close_tag,
            system_prompt=self.system_prompt,
        )
        attempts = self.max_retries + 1
        reply = ""
        for _ in range(attempts):
            reply = (await model.complete(messages, **self.model_params)).text
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

    async def _condense(
        self, model: ChatModel, role: str, feedback: str, entries: int, budget: int
    ) -> str:
        """Feedback within ``budget`` tokens: one summary call, then a hard cut if needed."""
        messages = summary_messages(role=role, feedback=feedback, entries=entries, max_tokens=budget)
        summary = (await model.complete(messages, **self.model_params)).text.strip() or feedback
        if approx_tokens(summary) <= budget:
            return summary
        limit = budget * 4
        if limit <= len(_TRUNCATED):
            return summary[:limit]
        return summary[: limit - len(_TRUNCATED)] + _TRUNCATED
