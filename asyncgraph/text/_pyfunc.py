"""Python functions in text graphs: ``PythonCall`` and ``DeterministicEvaluator``.

``PythonCall`` is TextGrad's ``StringBasedFunction``: the forward runs plain
Python (a parser, a formatter, a tool call) and the backward asks the feedback
model how each input should change, given what the function is for. The
``DeterministicEvaluator`` is afnio's: a metric in code that returns a score and
an explanation, the explanation being the feedback itself, so an exact-match
style metric drives TGD without an LLM judge.

Both keep only msgpack data in their ctx (the function is not needed by the
backward; ``PythonCall``'s options are one typed record, ``ctx.options``, a
``PythonCallOptions`` declared in ``ctx_types``), so a distributed executor can run
their backward on a worker.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from asyncgraph import Variable
from asyncgraph.models import reply_tokens
from asyncgraph.text._budget import feedback_within_budget
from asyncgraph.text._concurrency import run_all
from asyncgraph.text._feedback import render_feedback
from asyncgraph.text._fit import fitted_budget
from asyncgraph.text._functions import REMOTE_FUNCTIONS as _LLM_FUNCTIONS
from asyncgraph.text._functions import _TextFunction
from asyncgraph.text._options import PythonCallOptions
from asyncgraph.text._prompts import describe, function_feedback_messages
from asyncgraph.text._registry import ModelLike
from asyncgraph.text._reply import FEEDBACK_TOKENS

__all__ = [
    "REMOTE_FUNCTIONS",
    "DeterministicEvaluator",
    "PythonCall",
    "deterministic_evaluator",
    "python_call",
]

_PY_OPTIONS = PythonCallOptions.KEYWORDS


def _shown(value: Any) -> str:
    """How an input or output of the Python function is shown in its feedback request.

    Unlike a model call's text (``_functions._text``, which refuses a list: its Variables
    would leave the graph), a Python function takes any value, a list included, and
    gets it as it is; only its description is a string here."""
    data = value.data if isinstance(value, Variable) else value
    return data if isinstance(data, str) else str(data)


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _first_uses(values: list[Any]) -> list[bool]:
    """For each value: is it a Variable seen here for the first time (it gets the feedback)?"""
    seen: set[int] = set()
    first: list[bool] = []
    for value in values:
        is_new = isinstance(value, Variable) and id(value) not in seen
        if isinstance(value, Variable):
            seen.add(id(value))
        first.append(is_new)
    return first


async def _call(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


class PythonCall(_TextFunction):
    """Run a Python function on text: ``await PythonCall.apply(fn, *inputs, purpose=..., **named)``.

    Forward calls ``fn`` (sync or ``async def``) with the inputs' data
    (Variables unwrapped; other values passed as they are; named inputs as
    keyword arguments) and returns its result as a Variable with ``role``
    (default ``"output of <fn's name>"``); the result must be valid Variable
    data (text, numbers, lists, ...). It runs in the calling process, even
    under a distributed executor: ``fn`` is Python code of this process.

    Backward asks the feedback model, for each Variable input that needs a
    gradient, how that input should change given ``purpose`` (what the function
    does, in words: the model never sees its code), every input, the output and
    the feedback on the output; all requests at once. An empty output gradient
    means the output itself is the objective.

    Options (keyword only; the fields of ``PythonCallOptions``, not inputs of the node):
    ``purpose`` (required), ``role``, ``feedback_model`` / ``feedback_params`` (default:
    ``use_models`` / ``set_default_models``'s feedback model, else their model; needed
    only when an input requires grad), ``feedback_budget`` (see ``use_feedback_budget``).
    ``dispatch = "remote"``: the backward may run on a worker (pass the feedback model as
    a spec string for that).

    Example::

        def word_count(text):
            return len(text.split())

        count = await PythonCall.apply(
            word_count, answer, purpose="Counts the words of the answer.", role="word count"
        )
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "remote"
    remote_name: ClassVar[str | None] = "asyncgraph.text.PythonCall"
    ctx_types: ClassVar[Mapping[str, type[Any]]] = MappingProxyType({"options": PythonCallOptions})
    option_keywords: ClassVar[frozenset[str]] = _PY_OPTIONS

    @staticmethod
    async def forward(ctx: Any, fn: Any, *args: Any, **kwargs: Any) -> Variable:
        if not callable(fn):
            raise TypeError(
                f"PythonCall.apply(fn, *inputs, purpose=...): fn must be callable, got {fn!r:.80}"
            )
        # The node's inputs: fn, the positional inputs, then the named ones in the order
        # Function.apply lists them (call order, but for names in forward's signature);
        # the options are not inputs (``option_keywords``).
        keys = sorted(kwargs, key=lambda key: _FORWARD_ORDER.get(key, len(_FORWARD_ORDER)))
        named = {key: kwargs[key] for key in keys if key not in _PY_OPTIONS}
        options = PythonCallOptions.from_kwargs(
            f"PythonCall of {_name(fn)}()",
            {key: kwargs[key] for key in keys if key in _PY_OPTIONS},
            default_role=f"output of {_name(fn)}",
            needs_feedback=ctx.recorded,
        )

        values = [fn, *args, *named.values()]
        labels = ["", *(f"input {i}" for i in range(1, len(args) + 1)), *named]
        first = _first_uses(values)
        inputs: list[dict[str, Any]] = []
        slots: list[dict[str, Any]] = []
        for index, (value, label) in enumerate(zip(values, labels, strict=True)):
            if index == 0:
                continue
            item_role = describe(value.role if isinstance(value, Variable) else "", label)
            inputs.append({"role": item_role, "value": _shown(value)})
            if first[index]:
                slots.append({"index": index, "role": item_role, "value": _shown(value)})

        result = await _call(
            fn,
            [a.data if isinstance(a, Variable) else a for a in args],
            {k: v.data if isinstance(v, Variable) else v for k, v in named.items()},
        )
        if isinstance(result, Variable):
            result = result.data
        out = Variable(result, role=options.role)

        options.keep_local_models(ctx)  # model objects passed in live with the node
        ctx.options = options
        ctx.inputs = inputs
        ctx.slots = slots
        ctx.output = _shown(out)
        return out

    @staticmethod
    async def backward(ctx: Any, grad_output: Variable | None) -> tuple[Variable | None, ...]:
        options = PythonCallOptions.of(ctx)
        needs = list(ctx.needs_input_grad)
        grads: list[Variable | None] = [None] * len(needs)
        ref = options.feedback_model
        if grad_output is None or ref is None:
            return tuple(grads)
        params = dict(options.feedback_params)
        output_role = describe(options.role, "output of the function")

        async def complete(messages: list[dict[str, Any]]) -> str:
            completion = await ref.resolve().complete(messages, **params)
            return completion.text

        def request(slot: dict[str, Any], feedback: str) -> list[dict[str, Any]]:
            return function_feedback_messages(
                purpose=options.purpose,
                inputs=list(ctx.inputs),
                output=ctx.output,
                output_role=output_role,
                variable=slot["value"],
                variable_role=slot["role"],
                feedback=feedback,
            )

        asked = [slot for slot in ctx.slots if needs[slot["index"]]]
        budget, chunk = await fitted_budget(  # see asyncgraph.text._fit
            ref.resolve(),
            options.feedback_budget,
            [request(slot, "") for slot in asked],
            {
                "the function's purpose": options.purpose,
                "its output": ctx.output,
                "its inputs": "\n".join(str(i) for i in ctx.inputs),
            },
            f"the feedback request of {ctx.function_name}",
            FEEDBACK_TOKENS,
        )
        feedback, note = await feedback_within_budget(
            grad_output, budget=budget, role=output_role, ask=complete, chunk_tokens=chunk
        )

        async def ask(slot: dict[str, Any]) -> None:
            messages = request(slot, feedback)
            with reply_tokens(FEEDBACK_TOKENS):
                text = await complete(messages)
            if note is not None:  # the gradient says what it was built from
                text = f"{note}\n{text}"
            grads[slot["index"]] = Variable(text, role=f"feedback on {slot['role']}")

        await run_all([functools.partial(ask, slot) for slot in asked])
        return tuple(grads)


class DeterministicEvaluator(_TextFunction):
    """A metric in code whose explanation is the feedback: no LLM judge needed.

    ``score, explanation = await DeterministicEvaluator.apply(fn, *inputs, role=None)``
    calls ``fn(*datas)`` (sync or ``async def``; Variables unwrapped), which
    returns ``(score, explanation)``: the score (a number, not differentiated)
    and a text saying what is wrong, or ``""`` / None when nothing is. Use the
    explanation as the loss: its backward hands the explanation, as feedback, to
    every Variable input that needs a gradient (each distinct Variable once), and
    nothing when the explanation is empty, so a correct prediction sends no
    feedback upstream. Feedback arriving on the explanation itself (rare) is
    appended. No model call; ``dispatch = "local"`` (the ctx is plain data, so a
    subclass may set ``"remote"``).

    ``role`` names the explanation (default ``"evaluation of <the inputs'
    roles>"``); the score's role is ``"score of <that>"``.

    Example::

        def exact(prediction, target):
            if prediction.strip() == target:
                return 1.0, ""
            return 0.0, f"The answer should be {target!r}, not {prediction!r}."

        score, loss = await DeterministicEvaluator.apply(exact, answer, "42")
        await loss.backward()          # answer.grad: "The answer should be '42', not ..."
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "local"
    remote_name: ClassVar[str | None] = "asyncgraph.text.DeterministicEvaluator"

    @staticmethod
    async def forward(
        ctx: Any, fn: Any, *inputs: Any, role: str | None = None
    ) -> tuple[Variable, Variable]:
        if not callable(fn):
            raise TypeError(
                f"DeterministicEvaluator.apply(fn, *inputs): fn must be callable, got {fn!r:.80}"
            )
        if role is not None and not isinstance(role, str):
            raise TypeError(f"DeterministicEvaluator: role must be a str, got {role!r}")
        if role is None:
            roles = [describe(v.role, "") for v in inputs if isinstance(v, Variable) and v.role]
            role = f"evaluation of {' and '.join(roles)}" if roles else "evaluation"
        result = await _call(fn, [v.data if isinstance(v, Variable) else v for v in inputs], {})
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(
                f"DeterministicEvaluator: {_name(fn)}() must return (score, explanation), got "
                f"{result!r:.80}"
            )
        score, explanation = result
        if explanation is None:
            explanation = ""
        if not isinstance(explanation, str):
            raise TypeError(
                f"DeterministicEvaluator: the explanation {_name(fn)}() returned must be a str "
                f"(or None when there is nothing to fix), got {explanation!r:.80}"
            )
        score_var = Variable(score, role=f"score of {describe(role, 'evaluation')}")
        ctx.mark_non_differentiable(score_var)
        first = _first_uses([fn, *inputs])
        ctx.targets = [
            {"index": i, "role": describe(v.role, "input")}
            for i, v in enumerate([fn, *inputs])
            if first[i]
        ]
        ctx.explanation = explanation.strip()
        return score_var, Variable(explanation, role=role)

    @staticmethod
    def backward(
        ctx: Any, grad_score: Variable | None, grad_explanation: Variable | None
    ) -> tuple[Variable | None, ...]:
        needs = list(ctx.needs_input_grad)
        grads: list[Variable | None] = [None] * len(needs)
        if grad_explanation is None or not ctx.explanation:
            return tuple(grads)
        incoming = render_feedback(grad_explanation)
        data: str | list[str] = [ctx.explanation, incoming] if incoming else ctx.explanation
        for target in ctx.targets:
            if needs[target["index"]]:
                grads[target["index"]] = Variable(data, role=f"feedback on {target['role']}")
        return tuple(grads)


_FORWARD_ORDER = {
    name: i for i, name in enumerate(inspect.signature(PythonCall.forward).parameters)
}

for _cls in (PythonCall, DeterministicEvaluator):
    _cls.__module__ = "asyncgraph.text"  # the public home: what worker registries match

REMOTE_FUNCTIONS = (*_LLM_FUNCTIONS, PythonCall)
"""The text Functions whose backward may run on a worker (for a worker's registry)."""


async def python_call(
    fn: Callable[..., Any],
    *inputs: Variable | Any,
    purpose: str,
    role: str | None = None,
    feedback_model: ModelLike | None = None,
    feedback_params: Mapping[str, Any] | None = None,
    **named: Variable | Any,
) -> Variable:
    """``await PythonCall.apply(...)`` with a typed signature; see :class:`PythonCall`.

    ``feedback_budget=`` (an option, not an input; None: never condense) goes through
    ``**named`` to ``PythonCall``, whose options are the fields of ``PythonCallOptions``.

    Example::

        count = await python_call(
            lambda text: len(text.split()),
            answer,
            purpose="Counts the words.",
            role="word count",
            feedback_model="simulated",
        )
        print(count.data)
    """
    options: dict[str, Any] = {"purpose": purpose}
    for key, value in (
        ("role", role),
        ("feedback_model", feedback_model),
        ("feedback_params", feedback_params),
    ):
        if value is not None:
            options[key] = value
    out: Variable = await PythonCall.apply(fn, *inputs, **options, **named)
    return out


async def deterministic_evaluator(
    fn: Callable[..., Any], *inputs: Variable | Any, role: str | None = None
) -> tuple[Variable, Variable]:
    """``await DeterministicEvaluator.apply(...)`` typed; see :class:`DeterministicEvaluator`.

    Example::

        def check(prediction, target):
            return (1.0, "") if prediction == target else (0.0, f"It should be {target!r}.")

        score, loss = await deterministic_evaluator(check, answer, "4")
        await loss.backward()       # answer.grad: "It should be '4'."
    """
    score, explanation = await DeterministicEvaluator.apply(fn, *inputs, role=role)
    return score, explanation
