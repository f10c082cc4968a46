"""``TGD``: textual gradient descent, one model call per parameter, all at once."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgraph import Variable
from asyncgraph._exceptions import ReplySkippedWarning, UpdateParseError
from asyncgraph.models import BaseChatModel, ChatModel, reply_tokens
from asyncgraph.optim._optimizer import Closure, Optimizer, ParamGroup, Params
from asyncgraph.optim._prompts import ValueForm, retry_message, update_messages
from asyncgraph.text import (
    approx_tokens,
    ask_json,
    check_structured,
    condense_feedback,
    current_models,
    describe,
    feedback_defaults,
    feedback_entries,
    fit_for,
    parse_structured,
    render_feedback,
    resolve_model,
    run_all,
    truncate_to_tokens,
    update_tokens,
    uses_structured,
)

__all__ = ["TGD", "SkippedUpdate", "parse_tagged", "parse_value"]

DEFAULT_TAGS = ("<IMPROVED_VARIABLE>", "</IMPROVED_VARIABLE>")
UPDATE_FIELD = "improved_variable"
"""The JSON field an update comes back in when it is asked for with ``response_format``."""
_TRUNCATED = "\n[... feedback truncated to max_feedback_tokens]"
_MIN_FEEDBACK_TOKENS = 32  # approx tokens of feedback an update request must have room for
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


def parse_value(reply: str, form: ValueForm) -> str | None:
    """The value in ``reply`` as ``form`` asks for it: the JSON object's ``form.field``
    string (a reply in tags is read too), or the text between the tags; None if there is
    none. An empty value is ``""`` (not None), so a retry can say it was empty."""
    if form.field is not None:
        data, errors = parse_structured(reply, form.schema())
        if not errors and isinstance(data, dict) and isinstance(data.get(form.field), str):
            return _real(str(data[form.field]).strip())
    tagged = parse_tagged(reply, form.open_tag, form.close_tag)
    return None if tagged is None else _real(tagged)


def _real(value: str) -> str:
    """``value``, or "" when it is only a placeholder ("...", "…"): a small model copies the
    shape of an example instead of writing a value; the retry says it was empty."""
    return "" if not value.replace(".", "").replace("…", "").strip() else value


@dataclass(frozen=True)
class SkippedUpdate:
    """An update ``step()`` could not read from the model's replies: the parameter kept its
    value (see ``TGD(strict=...)``). ``role`` is the parameter's role, ``attempts`` the
    replies tried, ``reply`` the last one, ``structured`` whether it was asked for with
    ``response_format``.

    Example::

        await tgd.step()
        for skipped in tgd.skipped:
            print(skipped.role, skipped.attempts, skipped.reply[:80])
    """

    role: str
    attempts: int
    reply: str
    structured: bool

    def to_data(self) -> dict[str, Any]:
        """A JSON-ready summary (the reply cut to 300 characters), for histories."""
        return {
            "role": self.role,
            "attempts": self.attempts,
            "reply": _excerpt(self.reply),
            "structured": self.structured,
        }


def _examples(value: Any) -> list[str]:
    if isinstance(value, str) or not all(isinstance(item, str) for item in value):
        raise TypeError(
            f"TGD: in_context_examples must be a list of str, got {value!r:.80}"
            + ("; wrap it in a list" if isinstance(value, str) else "")
        )
    return list(value)


def _excerpt(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


_Outcome = tuple[str, str] | SkippedUpdate
"""An update's outcome: (new value, the feedback it was computed from), or skipped."""


class TGD(Optimizer):
    """Textual gradient descent: rewrite each text parameter from its feedback.

    ``await tgd.step()`` sends, for every parameter with non-empty feedback
    (``render_feedback(p.grad)``; parameters without any are left alone), one
    request to ``model`` asking for an improved value, all parameters
    concurrently, then sets every ``p.data`` at once: if any update fails, no
    parameter changes. The value is asked as a JSON object with structured outputs
    where the model takes them (``structured="auto"``, the default: OpenAI, Azure,
    vLLM, llama.cpp, Anthropic's forced tool), else between ``tags``
    (``<IMPROVED_VARIABLE>...</IMPROVED_VARIABLE>``); see ``structured`` below.

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
    ``structured``: how the new value comes back. ``"auto"`` (the default): as a
    JSON object ``{"improved_variable": "..."}`` sent with ``response_format`` (a JSON
    schema; a grammar on llama.cpp's server, a forced tool on Anthropic) where the
    model takes it (its ``structured_outputs``: the HTTP clients), else (a model
    that does not say, ``SimulatedModel``) between ``tags``; a server that refuses ``response_format`` is asked with the tags from
    then on. ``True``: always ``response_format``; ``False``: always the tags. A
    small model that ignores the tags and answers in prose still gives a value
    with structured outputs.
    ``max_retries``: when a reply has no value (or an empty one), the reply and a
    correction are sent back, up to this many extra times. Then, by default, the
    update is *skipped*: the parameter keeps its value, ``tgd.skipped`` lists it
    (a :class:`SkippedUpdate`, for the last step) and a ``ReplySkippedWarning``
    says so (a job records it in its history and progress line instead);
    ``strict=True`` raises ``UpdateParseError`` (naming the parameter's role and
    showing the reply) and no parameter changes. A reply that cannot be parsed
    is never stored in (or replayed from) the model's response cache
    (``cache_if`` of a ``BaseChatModel``), so the next step asks the model again.
    Each update asks for a reply of at most ``update_tokens(value)`` tokens
    (about twice the value's length; a model's own ``max_tokens`` wins).
    ``system_prompt`` replaces the built-in one.
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
        structured: bool | str = "auto",
        strict: bool = False,
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
        self.structured = check_structured(structured, "TGD")
        self.strict = bool(strict)
        self.skipped: list[SkippedUpdate] = []
        """The updates the last ``step()`` skipped (see the class docstring)."""
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
        self._staged: dict[Variable, tuple[Variable, Any, _Outcome | Exception]] = {}
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
        params = self._params()
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
        outcome: _Outcome | Exception
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
        self.skipped = []
        jobs = self._jobs()
        staged, self._staged = self._staged, {}
        if not jobs:
            return loss
        results: list[_Outcome | None] = [None] * len(jobs)
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
            if isinstance(result, SkippedUpdate):
                self.skipped.append(result)
                if self.warn_skipped:
                    warnings.warn(
                        ReplySkippedWarning(
                            f"TGD.step(): the update of the parameter with role {result.role!r} "
                            f"was skipped: no readable value in {result.attempts} repl"
                            f"{'y' if result.attempts == 1 else 'ies'} (last: "
                            f"{_excerpt(result.reply, 120)!r}); it keeps its value. "
                            "TGD(strict=True) raises UpdateParseError instead"
                        ),
                        stacklevel=2,
                    )
                continue
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
    ) -> _Outcome:
        """The new value of ``p`` and the feedback it was computed from (after the guard),
        or the skipped update (``strict=False``)."""
        role = describe(p.role, "variable")
        momentum = group["momentum"]
        history: list[dict[str, Any]] = list(self.state.get(p, {}).get("history", []))
        history = history[-momentum:] if momentum > 0 else []
        budget, chunk = await self._fitted_budget(model, p, group, role, len(history))
        feedback = render_feedback(entries)
        if budget is not None and approx_tokens(feedback) > budget:
            feedback = await self._condense(model, role, entries, budget, chunk)
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
        tags = ValueForm(open_tag, close_tag)
        json_form = ValueForm(open_tag, close_tag, UPDATE_FIELD)

        def request(form: ValueForm) -> list[dict[str, Any]]:
            return update_messages(
                role=role,
                value=p.data,
                feedback=feedback,
                history=history,
                constraints=group["constraints"],
                open_tag=open_tag,
                close_tag=close_tag,
                system_prompt=self.system_prompt,
                examples=group.get("in_context_examples", self.in_context_examples),
                form=form,
            )

        form = json_form if uses_structured(model, self.structured, unknown=False) else tags
        messages = request(form)
        attempts = self.max_retries + 1
        reply = ""
        with reply_tokens(update_tokens(p.data), whole=True):
            for _ in range(attempts):
                reply, form, messages = await self._reply(model, form, messages, request)
                value = parse_value(reply, form)
                if value:
                    return value, feedback
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    retry_message(role, open_tag, close_tag, empty=value is not None, form=form),
                ]
        if not self.strict:
            return SkippedUpdate(p.role, attempts, reply, form.field is not None)
        shape = (
            f'a JSON object with a non-empty "{form.field}"'
            if form.field is not None
            else f"a non-empty {open_tag}...{close_tag} span"
        )
        raise UpdateParseError(
            f"TGD could not read an improved value for the parameter with role {p.role!r}: "
            f"after {attempts} attempt(s) the model's reply has no {shape}. Last reply "
            f"({len(reply)} chars): {_excerpt(reply)!r}. The model must send the new value as "
            f"the optimizer's prompt says: check that it follows it, raise max_retries, use "
            f"structured outputs (structured=True, with a server that takes response_format), "
            f"or pass the tags it uses as tags=(open, close). No parameter was changed.",
            role=p.role,
            attempts=attempts,
            reply=reply,
        )

    async def _reply(
        self,
        model: ChatModel,
        form: ValueForm,
        messages: list[dict[str, Any]],
        request: Callable[[ValueForm], list[dict[str, Any]]],
    ) -> tuple[str, ValueForm, list[dict[str, Any]]]:
        """One reply to ``messages`` in ``form``; a server that refuses ``response_format``
        is asked the tags' way instead (the form and messages returned say which)."""
        if form.field is None:
            return (
                await self._ask(model, messages, lambda r: bool(parse_value(r, form))),
                form,
                messages,
            )
        tags = ValueForm(form.open_tag, form.close_tag)
        fallback = request(tags)
        completion, sent = await ask_json(
            model,
            messages,
            self._params(),
            form.schema(),
            structured=self.structured,
            fallback=fallback,
            strict=True,
            usable=lambda r: bool(parse_value(r, form)),
        )
        if sent:
            return completion.text, form, messages
        return completion.text, tags, fallback

    def _params(self) -> dict[str, Any]:
        if self.model_params is not None:
            return dict(self.model_params)
        return current_models().for_feedback()[2]  # the default feedback params

    async def _fitted_budget(
        self, model: ChatModel, p: Variable, group: ParamGroup, role: str, history: int
    ) -> tuple[int | None, int | None]:
        """``max_feedback_tokens``, lowered so that the update request fits ``model``'s
        context window with its reply (each of the feedback and the ``history`` past
        values and feedbacks getting an equal share of the room), and the summary chunk
        size; ``ModelContextError`` naming the parts when even an update request without
        feedback would not fit (see ``asyncgraph.text._fit``)."""
        budget: int | None = group["max_feedback_tokens"]
        fit = await fit_for(model)
        if fit is None:
            return budget, None
        reply = update_tokens(p.data)
        examples = group.get("in_context_examples", self.in_context_examples)
        probe = update_messages(
            role=role,
            value=p.data,
            feedback="",
            history=[],
            constraints=group["constraints"],
            open_tag=self.tags[0],
            close_tag=self.tags[1],
            system_prompt=self.system_prompt,
            examples=examples,
        )
        room = fit.room(probe, reply, whole=True) // (1 + 2 * history)
        if room < _MIN_FEEDBACK_TOKENS:
            parts = {
                "the value": p.data,
                "the constraints": "\n".join(group["constraints"]),
                "the examples": "\n".join(examples),
                "the system prompt": str(probe[0]["content"]),
            }
            raise fit.too_long(
                f"the update request of the parameter with role {p.role!r}",
                {k: v for k, v in parts.items() if v},
                fit.reply(reply, whole=True),
            )
        return (room if budget is None else min(budget, room)), fit.condense_tokens()

    async def _condense(
        self,
        model: ChatModel,
        role: str,
        entries: list[str],
        budget: int,
        chunk: int | None = None,
    ) -> str:
        """The feedback ``entries`` condensed into at most ``budget`` tokens (map-reduce:
        ``asyncgraph.text.condense_feedback``, the one every text node's budget uses)."""

        async def ask(messages: list[dict[str, Any]]) -> str:
            return await self._ask(model, messages, lambda reply: bool(reply.strip()))

        return await condense_feedback(
            entries, budget=budget, role=role, ask=ask, marker=_TRUNCATED, chunk_tokens=chunk
        )
