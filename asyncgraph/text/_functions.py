"""Text Functions: LLM calls, formatted LLM calls, concatenation and metrics.

Every Function here keeps only msgpack-friendly data in its ctx (strings,
numbers, lists, dicts; no saved Variables, no model objects), and the LLM calls
their options as one typed record, ``ctx.options`` (an ``LLMOptions``, declared in
``ctx_types``, holding model *references*), so a distributed executor can rebuild
the ctx on a worker and run the backward there. ``dispatch`` says where: the LLM calls default to ``"remote"``
(their backward calls a model), the cheap ones to ``"local"``. Change it per
class with a subclass::

    class LocalLLMCall(LLMCall):
        dispatch = "local"          # feedback requests always run in this process

A subclass gets its own ``remote_name`` (``module:QualName``) unless it sets one,
so a worker never confuses it with its base class. The public classes present
themselves as ``asyncgraph.text.X`` (``__module__``), so a worker serves them
with ``asyncgraph worker --import asyncgraph.text``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import string
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Unpack

from asyncgraph import Function, Variable
from asyncgraph.models import reply_tokens
from asyncgraph.text._budget import feedback_within_budget
from asyncgraph.text._concurrency import run_all
from asyncgraph.text._content import describe_content, is_image, wire_image, with_images
from asyncgraph.text._fit import MIN_FEEDBACK_TOKENS, fit_for
from asyncgraph.text._options import OUTPUT_ROLE, LLMKeywords, LLMOptions, check_keywords
from asyncgraph.text._prompts import describe, llm_feedback_messages, marks_shared_prefix
from asyncgraph.text._registry import ModelRef
from asyncgraph.text._reply import ANSWER_TOKENS, FEEDBACK_TOKENS
from asyncgraph.text._structured import (
    StructuredOutputError,
    ask_json,
    parse_structured,
    retry_message,
)

__all__ = [
    "ChatCall",
    "Concat",
    "ExactMatch",
    "FormattedLLMCall",
    "LLMCall",
    "Metric",
    "REMOTE_FUNCTIONS",
    "chat_call",
    "check_portable",
    "concat",
    "exact_match",
    "formatted_llm_call",
    "llm_call",
]

_LLM_CTX_TYPES: Mapping[str, type[Any]] = MappingProxyType({"options": LLMOptions})


class _TextFunction(Function):
    """Gives every subclass its own ``remote_name`` unless it declares one."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "remote_name" not in cls.__dict__:
            cls.remote_name = f"{cls.__module__}:{cls.__qualname__}"


def _text(value: Any) -> str:
    data = value.data if isinstance(value, Variable) else value
    if isinstance(data, str):
        return data
    if is_image(data):
        return describe_content(data)
    if not isinstance(value, Variable) and isinstance(data, (list, tuple, set)):
        # Its text would be the container's repr, and the Variables in it would leave the
        # graph (no gradient, no error): say so instead.
        raise TypeError(
            f"a {type(data).__name__} where a text was expected ({data!r:.80}): give a str "
            f"or a Variable; for several, pass each as an input of its own, or join them "
            f"with concat(...), which keeps each one in the graph"
        )
    return str(data)


def _images(values: Any) -> list[dict[str, Any]]:
    """The images among ``values`` (Variables or plain), as ctx data (``wire_image``)."""
    found = []
    for value in values:
        data = value.data if isinstance(value, Variable) else value
        if is_image(data):
            found.append(wire_image(data))
    return found


async def _complete(ref: ModelRef, messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    completion = await ref.resolve().complete(messages, **params)
    return completion.text


async def _feedback(ref: ModelRef, messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    """One feedback request (a reply of ``FEEDBACK_TOKENS`` at most)."""
    with reply_tokens(FEEDBACK_TOKENS):
        return await _complete(ref, messages, params)


def _slot(index: int, var: Variable, fallback: str) -> dict[str, Any]:
    return {"index": index, "role": describe(var.role, fallback), "value": _text(var)}


async def _llm_forward(
    ctx: Any,
    options: LLMOptions,
    system_prompt: str | None,
    user_prompt: str,
    slots: list[dict[str, Any]],
    images: list[dict[str, Any]],
    conversation: list[dict[str, Any]] | None = None,
) -> Variable:
    """Send the request (``conversation`` as is, or the system and user messages) and
    keep in ``ctx`` the options and what the backward's feedback requests show of it."""
    messages: list[dict[str, Any]] = []
    if conversation is not None:
        messages = list(conversation)
    else:
        if system_prompt is not None:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": with_images(user_prompt, images)})
    schema = options.response_format
    with reply_tokens(ANSWER_TOKENS, replace=False):  # a judge asks for a verdict's size
        if schema is None:
            output = await _complete(options.model, messages, dict(options.params))
            value: Any = output
        else:
            output, value = await _structured_reply(ctx, options, messages, schema)
    options.keep_local_models(ctx)  # model objects passed in live with the node
    ctx.options = options
    ctx.system_prompt = system_prompt
    ctx.user_prompt = user_prompt
    ctx.output = output
    ctx.slots = slots
    ctx.images = images  # msgpack bytes when the backward runs on a worker
    return Variable(value, role=options.role)


async def _structured_reply(
    ctx: Any, options: LLMOptions, messages: list[dict[str, Any]], schema: dict[str, Any]
) -> tuple[str, Any]:
    """The reply's text and its data, asked again with the errors until it follows
    ``schema`` (``format_attempts`` replies in all); ``StructuredOutputError`` then. The
    schema goes as ``response_format`` where the model takes it, else in the prompt
    (``ask_json``)."""
    attempts = options.format_attempts
    model = options.model.resolve()
    for attempt in range(1, attempts + 1):
        completion, _ = await ask_json(model, messages, options.params, schema)
        output = completion.text
        data, errors = parse_structured(output, schema)
        if not errors:
            return output, data
        if attempt == attempts:
            path = errors[0].split(":", 1)[0]
            raise StructuredOutputError(
                f"{ctx.function_name}: the model's reply did not follow the response_format "
                f"schema {schema.get('title', '')!r} after {attempts} attempt(s); at {path}: "
                f"{errors[0].split(': ', 1)[-1]} ({len(errors)} error(s) in all). Last reply: "
                f"{output[:200]!r}. Raise format_attempts, simplify the schema, or use a "
                f"model that supports structured outputs",
                path=path,
                reply=output,
                attempts=attempts,
            )
        messages = [*messages, {"role": "assistant", "content": output}, retry_message(errors)]
    raise AssertionError("unreachable")  # the loop returns or raises


async def _llm_backward(ctx: Any, grad_output: Variable | None) -> tuple[Variable | None, ...]:
    """One feedback request per input that needs a gradient, all sent at once."""
    options = LLMOptions.of(ctx)
    needs = list(ctx.needs_input_grad)
    grads: list[Variable | None] = [None] * len(needs)
    if grad_output is None:
        return tuple(grads)
    ref = options.feedback_model or options.model
    params = options.request_params
    output_role = describe(options.role, OUTPUT_ROLE)
    images: list[dict[str, Any]] = ctx.images
    asked = [slot for slot in ctx.slots if needs[slot["index"]]]
    mark = bool(asked) and not images and marks_shared_prefix(ref.resolve())

    quoted: set[int] = set()  # inputs shown by reference to the call's input (see below)

    def request(slot: dict[str, Any], feedback: str) -> list[dict[str, Any]]:
        variable = slot["value"]
        if slot["index"] in quoted:
            variable = f"(the text given as {slot['role']} in LM_INPUT above)"
        return llm_feedback_messages(
            system_prompt=ctx.system_prompt,
            user_prompt=ctx.user_prompt,
            output=ctx.output,
            output_role=output_role,
            variable=variable,
            variable_role=slot["role"],
            feedback=feedback,
            mark_shared=mark,
        )

    budget, chunk = await _fitted_budget(ctx, ref, options, asked, request, quoted)
    feedback, note = await feedback_within_budget(
        grad_output,
        budget=budget,
        role=output_role,
        ask=functools.partial(_complete, ref, params=params),
        chunk_tokens=chunk,
    )

    async def ask(slot: dict[str, Any]) -> None:
        messages = request(slot, feedback)
        if images:  # the feedback model sees what the forward saw
            messages[-1] = {**messages[-1], "content": with_images(messages[-1]["content"], images)}
        text = await _feedback(ref, messages, params)
        if note is not None:  # the gradient says what it was built from
            text = f"{note}\n{text}"
        grads[slot["index"]] = Variable(text, role=f"feedback on {slot['role']}")

    await run_all([functools.partial(ask, slot) for slot in asked])
    return tuple(grads)


async def _fitted_budget(
    ctx: Any,
    ref: ModelRef,
    options: LLMOptions,
    asked: list[dict[str, Any]],
    request: Callable[[dict[str, Any], str], list[dict[str, Any]]],
    quoted: set[int],
) -> tuple[int | None, int | None]:
    """The feedback budget and summary chunk size for this node's feedback model: the
    options' budget, lowered to what its context window leaves in the largest feedback
    request (see ``asyncgraph.text._fit``); ``ModelContextError`` naming the parts when
    the request would not fit even without feedback.

    Before the request is given up, two things make room, in turn: an input quoted
    twice because it is also in the call's prompt (a judge's answer) is shown once, by
    reference (its index added to ``quoted``); then the reply is given fewer tokens
    than its share of the window (``Fit.feedback_room``). Counts err high (the lowest
    characters per token the server has shown), so these matter most on a small window."""
    fit = await fit_for(ref.resolve())
    if fit is None or not asked:
        return options.feedback_budget, None

    def probe() -> list[dict[str, Any]]:
        return max((request(slot, "") for slot in asked), key=fit.limits.count)

    if fit.room(probe(), FEEDBACK_TOKENS) < MIN_FEEDBACK_TOKENS:
        quoted.update(
            slot["index"]
            for slot in asked
            if slot["value"]
            and slot["value"] != ctx.system_prompt
            and slot["value"] in ctx.user_prompt
        )
    left, reply = fit.feedback_room([probe()], FEEDBACK_TOKENS)
    if left < MIN_FEEDBACK_TOKENS:
        parts = {
            "the system prompt": ctx.system_prompt or "",
            "the prompt (inputs)": ctx.user_prompt,
            "the output": ctx.output,
            "the variable": max(
                (str(slot["value"]) for slot in asked if slot["index"] not in quoted),
                key=len,
                default="",
            ),
        }
        raise fit.too_long(
            f"the feedback request of {ctx.function_name}",
            {k: v for k, v in parts.items() if v},
            fit.reply(reply),
            request=probe(),
        )
    budget = left if options.feedback_budget is None else min(options.feedback_budget, left)
    return budget, fit.condense_tokens()


class _LLMFunction(_TextFunction):
    """What the LLM calls share: a backward on a worker by default, the options as one
    ``LLMOptions`` on ``ctx.options`` (not inputs), and one backward (``_llm_backward``)."""

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"
    ctx_types: ClassVar[Mapping[str, type[Any]]] = _LLM_CTX_TYPES
    option_keywords: ClassVar[frozenset[str]] = LLMOptions.KEYWORDS

    @staticmethod
    async def backward(ctx: Any, grad_output: Variable | None) -> tuple[Variable | None, ...]:
        return await _llm_backward(ctx, grad_output)


class LLMCall(_LLMFunction):
    """Call a language model: ``await LLMCall.apply(system_prompt, *inputs, model=...)``.

    Forward sends ``system_prompt`` (a Variable, a str, or None for none) as the
    system message and the inputs (Variables or str, joined by blank lines) as
    the user message, and returns the reply as a Variable with ``role`` (default
    ``"response from the language model"``).

    Backward asks the model, for each Variable input that needs a gradient (the
    system prompt included), how that input should change given the feedback on
    the reply; all of these requests are sent concurrently. The prompts name
    variables by their roles. An empty output gradient (``""``, the implicit
    gradient of a text loss) means the reply itself is the objective.

    Options (keyword only; those not given come from ``use_models`` /
    ``set_default_models``): ``model`` (a spec such as ``"simulated"``
    or ``"openai:gpt-4o-mini"``, a registered name, or a ChatModel instance; see
    ``resolve_model``), ``base_url`` (with a spec), ``params`` (model parameters,
    e.g. ``{"temperature": 0}``), ``feedback_model`` / ``feedback_params`` (for
    the backward's requests; default: the same; a ``feedback_model`` spec
    resolves without ``base_url``: register a name for another server),
    ``role``, ``feedback_budget`` (see ``use_feedback_budget``), ``response_format``
    and ``format_attempts`` (structured outputs): the fields of :class:`LLMOptions`,
    and ``base_url``. An unknown name is a ``TypeError`` naming the valid ones. The
    options are not inputs of the node (``option_keywords``: ``ctx.needs_input_grad`` has
    one entry per positional input); the node keeps them, resolved, as ``ctx.options``
    (an :class:`LLMOptions`), which is all its backward reads of them.

    ``dispatch = "remote"``: a distributed executor may run the backward on a
    worker, which resolves the model spec with its own ``resolve_model``; for
    that, pass the model as a spec string (or a name every worker registers),
    not as a ChatModel object, which only this process knows
    (``check_portable(loss)`` finds such nodes before the backward).
    Model errors propagate (``asyncgraph.models.ModelError``).

    Example::

        prompt = Parameter("Answer concisely.", role="system prompt")
        question = Variable("What is 6 * 7?", role="question")
        answer = await LLMCall.apply(prompt, question, model="openai:gpt-4o-mini")
    """

    remote_name: ClassVar[str | None] = "asyncgraph.text.LLMCall"

    @staticmethod
    async def forward(ctx: Any, *args: Any, **options: Any) -> Variable:
        if not args:
            raise TypeError(
                "LLMCall.apply(system_prompt, *inputs, model=...) needs a system_prompt "
                "(a Variable, a str, or None)"
            )
        opts = LLMOptions.from_kwargs("LLMCall", options)
        system, inputs = args[0], args[1:]
        if not inputs:
            raise TypeError(
                "LLMCall.apply(system_prompt, *inputs, model=...) needs at least one input"
            )
        slots: list[dict[str, Any]] = []
        if isinstance(system, Variable):
            slots.append(_slot(0, system, "system prompt"))
        for i, item in enumerate(inputs, 1):
            if isinstance(item, Variable):
                slots.append(_slot(i, item, "input to the language model"))
        system_text = None if system is None else _text(system)
        user_prompt = "\n\n".join(_text(item) for item in inputs)
        return await _llm_forward(ctx, opts, system_text, user_prompt, slots, _images(inputs))


_CHAT_ROLES = ("system", "user", "assistant", "developer")


class ChatCall(_LLMFunction):
    """An LLM call built from a list of messages (afnio's ChatCompletion shape).

    ``await ChatCall.apply(roles, *contents, model=...)``: ``roles[i]`` (``"system"``,
    ``"user"``, ``"assistant"`` or ``"developer"``) is the role of message ``i``,
    ``contents[i]`` its content, a str or a Variable. Every Variable content that needs a
    gradient gets its own feedback (one request each, all at once), naming its turn, so
    a system prompt, a few-shot assistant turn and the last user turn can all be
    optimized. ``chat_call(messages, ...)`` takes ``[{"role": ..., "content": ...}]``
    directly. Options as ``LLMCall`` (``response_format`` included); ``dispatch =
    "remote"``.

    Example::

        system = Parameter("You are a terse assistant.", role="system prompt")
        shot = Parameter("4", role="example answer")
        reply = await chat_call(
            [{"role": "system", "content": system},
             {"role": "user", "content": "2 + 2?"},
             {"role": "assistant", "content": shot},
             {"role": "user", "content": question}],
            model="openai:gpt-4o-mini",
        )
    """

    remote_name: ClassVar[str | None] = "asyncgraph.text.ChatCall"

    @staticmethod
    async def forward(ctx: Any, roles: Any, *contents: Any, **options: Any) -> Variable:
        if not isinstance(roles, (list, tuple)) or not all(r in _CHAT_ROLES for r in roles):
            raise TypeError(
                f"ChatCall.apply(roles, *contents): roles must be a list of {_CHAT_ROLES!r}, "
                f"one per message, got {roles!r:.80}"
            )
        if len(roles) != len(contents) or not contents:
            raise TypeError(
                f"ChatCall.apply(roles, *contents): {len(roles)} role(s) for "
                f"{len(contents)} message content(s); give one role per message"
            )
        opts = LLMOptions.from_kwargs("ChatCall", options)
        turns = [{"role": r, "content": _text(c)} for r, c in zip(roles, contents, strict=True)]
        slots = [
            _slot(i, c, f"{r} message {i + 1} of the conversation")
            for i, (r, c) in enumerate(zip(roles, contents, strict=True), 1)
            if isinstance(c, Variable)
        ]
        transcript = "\n\n".join(
            f"<{t['role'].upper()}_MESSAGE>\n{t['content']}\n</{t['role'].upper()}_MESSAGE>"
            for t in turns
        )
        return await _llm_forward(ctx, opts, None, transcript, slots, [], conversation=turns)


class FormattedLLMCall(_LLMFunction):
    """An LLM call whose user message is a template with named fields.

    ``await FormattedLLMCall.apply(template, system_prompt=None, *, model=..., **fields)``
    fills ``template`` (``str.format`` syntax, plain field names) with the
    fields' text and calls the model like :class:`LLMCall`. Each field is a
    Variable (differentiable: backward asks for feedback on it, naming it by its
    role or else by its field name) or a str. Options as in :class:`LLMCall`;
    a field cannot be called ``system_prompt`` or like an option
    (``LLMOptions.KEYWORDS``).
    Raises ``ValueError`` when the fields given differ from the template's.

    Example::

        draft = await FormattedLLMCall.apply(
            "Question: {question}\\nNotes: {notes}",
            instructions,
            model="simulated",
            question=question,
            notes=notes,
        )
    """

    remote_name: ClassVar[str | None] = "asyncgraph.text.FormattedLLMCall"

    @staticmethod
    async def forward(ctx: Any, *args: Any, **kwargs: Any) -> Variable:
        if not 1 <= len(args) <= 2:
            raise TypeError(
                "FormattedLLMCall.apply(template, system_prompt=None, *, model=..., **fields) "
                f"takes 1 or 2 positional arguments, got {len(args)}"
            )
        template = args[0]
        if not isinstance(template, str):
            raise TypeError(f"FormattedLLMCall: template must be a str, got {template!r:.80}")
        known = LLMOptions.KEYWORDS
        # The node's inputs: the positional arguments, then the other keywords in call
        # order (the options are not inputs: ``option_keywords``).
        named = [k for k in kwargs if k not in known]
        positions = {name: len(args) + i for i, name in enumerate(named)}
        if len(args) == 2 and "system_prompt" in kwargs:
            raise TypeError("FormattedLLMCall got system_prompt twice (positional and keyword)")
        system = args[1] if len(args) == 2 else kwargs.get("system_prompt")
        opts = LLMOptions.from_kwargs(
            "FormattedLLMCall", {k: v for k, v in kwargs.items() if k in known}
        )
        fields = {k: kwargs[k] for k in named if k != "system_prompt"}
        wanted = _template_fields(template)
        if set(fields) != wanted:
            raise ValueError(
                f"FormattedLLMCall: the template's fields are {sorted(wanted)!r} but the fields "
                f"given are {sorted(fields)!r}; missing: {sorted(wanted - set(fields))!r}, "
                f"unused: {sorted(set(fields) - wanted)!r}"
            )
        slots: list[dict[str, Any]] = []
        if isinstance(system, Variable):
            index = 1 if len(args) == 2 else positions["system_prompt"]
            slots.append(_slot(index, system, "system prompt"))
        for name, value in fields.items():
            if isinstance(value, Variable):
                slots.append(_slot(positions[name], value, f"'{name}' field of the prompt"))
        user_prompt = template.format(**{name: _text(value) for name, value in fields.items()})
        system_text = None if system is None else _text(system)
        ctx.template = template
        images = _images(fields.values())
        return await _llm_forward(ctx, opts, system_text, user_prompt, slots, images)


def _template_fields(template: str) -> set[str]:
    names: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"FormattedLLMCall: bad template {template!r:.80}: {exc}") from exc
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not field.isidentifier():
            raise ValueError(
                f"FormattedLLMCall: template field {{{field}}} must be a plain name "
                f"(no positional fields, attributes or indexing); double the braces for a "
                f"literal brace: '{{{{' and '}}}}'"
            )
        names.add(field)
    return names


class Concat(_TextFunction):
    """Join texts: ``Concat.apply(*texts, separator="\\n\\n", role=None)``.

    Inputs are Variables or str; the output's role defaults to
    ``"concatenation of <roles>"``. Backward makes no model call: the feedback
    on the concatenation goes unchanged to each Variable input that needs it,
    once per distinct Variable (a Variable passed twice gets it once). Use it to
    aggregate a batch of losses into one: ``await concat(*losses).backward()``.
    ``dispatch = "local"``: cheap, runs inline.
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "local"
    remote_name: ClassVar[str | None] = "asyncgraph.text.Concat"

    @staticmethod
    def forward(
        ctx: Any, *texts: Any, separator: str = "\n\n", role: str | None = None
    ) -> Variable:
        if not texts:
            raise TypeError("Concat.apply(*texts) needs at least one text")
        if not isinstance(separator, str):
            raise TypeError(f"Concat: separator must be a str, got {separator!r}")
        seen: set[int] = set()
        first_use: list[bool] = []
        for item in texts:
            first = isinstance(item, Variable) and id(item) not in seen
            if isinstance(item, Variable):
                seen.add(id(item))
            first_use.append(first)
        ctx.first_use = first_use
        if role is None:
            roles = [item.role for item in texts if isinstance(item, Variable) and item.role]
            role = f"concatenation of {', '.join(roles)}" if roles else "concatenation of texts"
        return Variable(separator.join(_text(item) for item in texts), role=role)

    @staticmethod
    def backward(ctx: Any, grad_output: Variable | None) -> tuple[Variable | None, ...]:
        needs = list(ctx.needs_input_grad)
        first_use = list(ctx.first_use)
        grads: list[Variable | None] = [None] * len(needs)
        if grad_output is None:
            return tuple(grads)
        for i, first in enumerate(first_use):
            if first and needs[i]:
                grads[i] = Variable(copy.copy(grad_output.data), role=grad_output.role)
        return tuple(grads)


class ExactMatch(_TextFunction):
    """A non-differentiable metric: 1.0 if ``prediction`` equals ``target``, else 0.0.

    ``ExactMatch.apply(prediction, target, ignore_case=False)`` compares the
    texts with surrounding whitespace stripped (and case folded with
    ``ignore_case=True``). The output does not require grad: combine it with an
    LLM judge (:class:`TextLoss`) for feedback.
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "local"
    remote_name: ClassVar[str | None] = "asyncgraph.text.ExactMatch"

    @staticmethod
    def forward(ctx: Any, prediction: Any, target: Any, *, ignore_case: bool = False) -> Variable:
        a, b = _text(prediction).strip(), _text(target).strip()
        if ignore_case:
            a, b = a.casefold(), b.casefold()
        role = (
            prediction.role
            if isinstance(prediction, Variable) and prediction.role
            else "prediction"
        )
        out = Variable(1.0 if a == b else 0.0, role=f"exact match of {role}")
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Variable | None) -> tuple[None, ...]:
        return (None,) * len(ctx.needs_input_grad)


class Metric(_TextFunction):
    """A non-differentiable metric computed by a user function.

    ``await Metric.apply(fn, *inputs, role="metric")`` returns
    ``Variable(fn(*datas), role=role)``, where ``datas`` are the inputs' data
    (Variables are unwrapped, other values passed as is). ``fn`` may be sync or
    ``async def``; its result must be valid Variable data (a number, a str, ...).
    The output does not require grad.

    Example::

        score = await Metric.apply(lambda p, t: float(t in p), answer, target, role="contains")
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "local"
    remote_name: ClassVar[str | None] = "asyncgraph.text.Metric"

    @staticmethod
    async def forward(
        ctx: Any, fn: Callable[..., Any], *inputs: Any, role: str = "metric"
    ) -> Variable:
        if not callable(fn):
            raise TypeError(f"Metric.apply(fn, *inputs): fn must be callable, got {fn!r:.80}")
        result = fn(*(item.data if isinstance(item, Variable) else item for item in inputs))
        if inspect.isawaitable(result):
            result = await result
        out = Variable(result, role=role)
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Variable | None) -> tuple[None, ...]:
        return (None,) * len(ctx.needs_input_grad)


for _cls in (LLMCall, FormattedLLMCall, ChatCall, Concat, ExactMatch, Metric):
    _cls.__module__ = "asyncgraph.text"  # the public home: what worker registries match

REMOTE_FUNCTIONS: tuple[type[Function], ...] = (LLMCall, FormattedLLMCall, ChatCall)
"""The text Functions whose backward may run on a worker (for a worker's registry)."""


def check_portable(*outputs: Variable) -> None:
    """Check, before a distributed backward, that workers can resolve every model.

    Walks the graph behind ``outputs`` (e.g. the loss) and raises ``ValueError`` naming
    each ``dispatch = "remote"`` text node whose model (or ``feedback_model``) was passed
    as a model *object*: its ``ModelRef`` is not ``portable``, a worker would fail with
    ``UnknownModelError``. The message says what to do instead (a spec string, or a name
    registered with ``register_model`` in the app and in every worker). Returns None when
    every remote node names its models portably; a local backward needs no check.

    Example::

        loss = await TextLoss("Evaluate the answer.", model="openai:gpt-4o-mini")(answer)
        check_portable(loss)
        await loss.backward(executor=redis_executor)
    """
    problems: list[str] = []
    seen: set[int] = set()
    stack = [v.grad_fn for v in outputs if isinstance(v, Variable) and v.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        function = node.function
        if (
            issubclass(function, _TextFunction)
            and function.dispatch == "remote"
            and "options" in function.ctx_types
        ):
            options = function.ctx_types["options"].of(node.ctx)
            for attr, ref in options.model_refs().items():
                if not ref.portable:
                    problems.append(f"{node.describe()}: {attr}={ref.spec!r}")
        for edge in node.next_edges:
            if edge is not None and not isinstance(edge[0], Variable):
                stack.append(edge[0])
    if problems:
        listed = "\n  ".join(sorted(problems))
        raise ValueError(
            f"{len(problems)} remote text node(s) name a model passed as an object, which only "
            f"this process knows; a worker cannot resolve it:\n  {listed}\nPass model= a spec "
            f"string such as 'openai:gpt-4o-mini' (with base_url=) or 'simulated', or register "
            f"the model under one name in the app and in every worker "
            f"(asyncgraph.text.register_model(name, model) in a module the worker imports with "
            f"asyncgraph worker --import your_module) and pass model=name; or run this backward "
            f"locally."
        )


async def llm_call(
    system_prompt: Variable | str | None, *inputs: Variable | str, **options: Unpack[LLMKeywords]
) -> Variable:
    """``await LLMCall.apply(...)`` with a typed signature; see :class:`LLMCall`.

    ``options``: the keyword options of :class:`LLMOptions` (``model``, ``base_url``,
    ``params``, ``feedback_model``, ``feedback_params``, ``role``, ``feedback_budget``,
    ``response_format``, ``format_attempts``), typed for the checker by ``LLMKeywords``
    (``asyncgraph.text._options``); None, or leaving one out, takes its default.
    ``response_format``: a JSON schema, dataclass or TypedDict; the output is then the
    reply parsed into data (see ``asyncgraph.text.StructuredOutputError``).

    Example::

        prompt = Parameter("Answer concisely.", role="system prompt")
        answer = await llm_call(prompt, Variable("What is 6 * 7?", role="question"), model="simulated")
        print(answer.data)
    """
    check_keywords("llm_call", options, LLMOptions.KEYWORDS)
    out: Variable = await LLMCall.apply(system_prompt, *inputs, **options)
    return out


async def formatted_llm_call(
    template: str,
    fields: Mapping[str, Variable | str],
    *,
    system_prompt: Variable | str | None = None,
    **options: Unpack[LLMKeywords],
) -> Variable:
    """``await FormattedLLMCall.apply(...)`` with the fields as a mapping; see there.
    Options as in :func:`llm_call`.

    Example::

        draft = await formatted_llm_call(
            "Question: {question} Notes: {notes}",
            {"question": question, "notes": notes},
            system_prompt=instructions,
            model="simulated",
        )
    """
    check_keywords("formatted_llm_call", options, LLMOptions.KEYWORDS)
    clash = sorted((LLMOptions.KEYWORDS | {"system_prompt"}) & set(fields))
    if clash:
        raise ValueError(
            f"formatted_llm_call: field name(s) {clash!r} are option names; rename them in "
            f"the template"
        )
    out: Variable = await FormattedLLMCall.apply(template, system_prompt, **options, **fields)
    return out


async def chat_call(
    messages: Sequence[Mapping[str, Any]], **options: Unpack[LLMKeywords]
) -> Variable:
    """``await ChatCall.apply(...)`` from ``[{"role": ..., "content": str | Variable}]``.
    Options as in :func:`llm_call`.

    Example::

        reply = await chat_call(
            [{"role": "system", "content": Parameter("Be terse.", role="system prompt")},
             {"role": "user", "content": "2 + 2?"}],
            model="simulated",
        )
    """
    check_keywords("chat_call", options, LLMOptions.KEYWORDS)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise TypeError(
                f"chat_call: message {i} must be a dict with 'role' and 'content', got "
                f"{message!r:.80}"
            )
        if isinstance(message["content"], (list, tuple)):
            raise TypeError(
                f"chat_call: message {i}'s content is a {type(message['content']).__name__}; "
                f"give one str or Variable (join several with concat(...), which keeps each "
                f"one in the graph), or one message each"
            )
    roles = tuple(m["role"] for m in messages)
    out: Variable = await ChatCall.apply(roles, *(m["content"] for m in messages), **options)
    return out


def concat(*texts: Variable | str, separator: str = "\n\n", role: str | None = None) -> Variable:
    """``Concat.apply(...)`` with a typed signature; see :class:`Concat`.

    Example::

        transcript = concat("Q: capital of France?", answer, role="transcript")
        print(transcript.data)      # the two texts, a blank line between them
    """
    out: Variable = Concat.apply(*texts, separator=separator, role=role)
    return out


def exact_match(
    prediction: Variable | str, target: Variable | str, *, ignore_case: bool = False
) -> Variable:
    """``ExactMatch.apply(...)`` with a typed signature; see :class:`ExactMatch`.

    Example::

        score = exact_match(answer, "Paris", ignore_case=True)
        print(score.data)           # 1.0 when the answer is "paris", else 0.0
    """
    out: Variable = ExactMatch.apply(prediction, target, ignore_case=ignore_case)
    return out
