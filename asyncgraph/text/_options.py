"""Typed options of the text Functions: what one model call was asked to do, as one record.

A text Function reads its keyword options once, in forward, into a frozen dataclass that
it keeps on the ctx as ``ctx.options``; its backward reads them from there and nowhere
else. :class:`LLMOptions` serves ``LLMCall``, ``FormattedLLMCall`` and ``ChatCall``;
:class:`PythonCallOptions` serves ``PythonCall``.

- The record's fields are the one list of a call's options: ``KEYWORDS`` (the names a
  call takes) is derived from them, and the wrappers' keyword signature
  (:class:`LLMKeywords`, for the type checker) is held equal to them by a test. The
  Functions declare the names as ``option_keywords``, so options are not node inputs.
- ``from_kwargs`` is the one place where a call's keyword options are checked and
  completed: an unknown name is a ``TypeError`` naming the valid ones, a Variable given
  as an option a ``TypeError``; options not given come from ``use_models`` /
  ``set_default_models`` and ``use_feedback_budget`` / ``set_feedback_budget``, read
  now, when the Function is applied; models become ``ModelRef``s.
- The constructor checks and normalises every field, so a record rebuilt from the wire
  is held to the same rules as one built in forward.
- ``of(ctx)`` reads the record back: a ctx without one is an ``AttributeError`` naming
  ``ctx.options``, and a misspelt field an ``AttributeError`` too (a frozen dataclass
  has no default for a name it does not have).
- The Functions declare ``ctx_types = {"options": LLMOptions}``, so a distributed
  executor sends the record as ``to_data()`` (a map of plain data, model references as
  ``{"spec", "base_url"}``) and a worker rebuilds it with ``from_data``, which wants
  exactly the record's fields and goes through the constructor. Nothing is pickled,
  and the class comes from the worker's registered Function, not from the message.

Example::

    answer = await llm_call(prompt, question, model="simulated", params={"temperature": 0})
    answer.grad_fn.ctx.options.params        # {'temperature': 0}
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar, Self, TypedDict

from asyncgraph import Variable
from asyncgraph.models import ChatModel
from asyncgraph.text._budget import DEFAULT_FEEDBACK_BUDGET, _check_budget, current_feedback_budget
from asyncgraph.text._defaults import feedback_defaults, with_defaults
from asyncgraph.text._registry import ModelLike, ModelRef, model_ref
from asyncgraph.text._structured import DEFAULT_STRUCTURED_ATTEMPTS, json_schema_of

__all__ = [
    "OUTPUT_ROLE",
    "CallKeywords",
    "LLMKeywords",
    "LLMOptions",
    "PythonCallOptions",
    "check_keywords",
]

OUTPUT_ROLE = "response from the language model"
"""The role of an LLM call's reply when the call gives none."""


def _params(value: Any, name: str, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{where}: {name} must be a dict of model parameters, got {value!r:.80}")
    return dict(value)


def check_keywords(
    function: str,
    kwargs: Mapping[str, Any],
    keywords: frozenset[str],
    *,
    unknown_are: str = "keyword argument(s)",
) -> None:
    """``TypeError`` naming the valid ``keywords`` when ``kwargs`` has another name."""
    unknown = sorted(set(kwargs) - keywords)
    if unknown:
        raise TypeError(
            f"{function} got unexpected {unknown_are} {unknown!r}; its options are "
            f"{sorted(keywords)!r}"
        )


def _plain(function: str, kwargs: Mapping[str, Any]) -> None:
    for name, value in kwargs.items():
        if isinstance(value, Variable):
            raise TypeError(
                f"{function}: option {name}= must be plain data, got a Variable ({value!r}); "
                f"pass its .data, or pass the Variable as an input"
            )


def _check_given(
    function: str, kwargs: Mapping[str, Any], known: frozenset[str], *, unknown_are: str
) -> None:
    """The options given to ``function`` have names from ``known`` (else ``TypeError``
    listing the others as ``unknown_are`` and naming the valid ones) and plain values."""
    check_keywords(function, kwargs, known, unknown_are=unknown_are)
    _plain(function, kwargs)


def _budget(function: str, kwargs: Mapping[str, Any]) -> int | None:
    # None is a real value here (no condensing), not "not given".
    if "feedback_budget" in kwargs:
        return current_feedback_budget(kwargs["feedback_budget"], where=function)
    return current_feedback_budget()


class _CtxRecord:
    """What the option records share: their wire form and how a backward reads them."""

    _MODEL_FIELDS: ClassVar[tuple[str, ...]] = ()
    """The fields holding a ``ModelRef`` (or None)."""

    def to_data(self) -> dict[str, Any]:
        """The record as plain data (msgpack-ready): each field, a model as ``to_data()``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_data() if isinstance(value, ModelRef) else value
        return out

    @classmethod
    def from_data(cls, data: Any) -> Self:
        """The record ``to_data()`` gave (also after msgpack); ``TypeError`` or ``ValueError``
        when ``data`` lacks a field, has another, or holds a value the constructor refuses."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if not isinstance(data, dict):
            raise TypeError(
                f"{cls.__name__} data must be a map of {names!r}, got {type(data).__name__}"
            )
        missing = sorted(set(names) - set(data))
        unknown = sorted(map(repr, set(data) - set(names)))
        if missing or unknown:
            raise TypeError(
                f"{cls.__name__} data must hold exactly the fields {names!r}; missing: "
                f"{missing!r}, unknown: {unknown!r}"
            )
        values = {
            name: ModelRef.from_data(data[name])
            if name in cls._MODEL_FIELDS and data[name] is not None
            else data[name]
            for name in names
        }
        return cls(**values, where=f"{cls.__name__}.from_data")  # type: ignore[call-arg]

    @classmethod
    def of(cls, ctx: Any) -> Self:
        """``ctx.options``, the record the forward stored; ``AttributeError`` when the ctx
        has none, ``TypeError`` when it holds something else."""
        name = getattr(ctx, "function_name", "") or "this Function"  # for the message only
        try:
            options = ctx.options
        except AttributeError:
            raise AttributeError(
                f"{name}: ctx.options is missing; the forward stores the call's "
                f"{cls.__name__} there and the backward reads it from nowhere else (was the "
                f"forward run, and did the ctx travel with its options?)"
            ) from None
        if not isinstance(options, cls):
            raise TypeError(
                f"{name}: ctx.options must be a {cls.__name__}, got {type(options).__name__} "
                f"({options!r:.80})"
            )
        return options

    def model_refs(self) -> dict[str, ModelRef]:
        """The models the record names, by option name (``model``, ``feedback_model``)."""
        refs = {name: getattr(self, name) for name in self._MODEL_FIELDS}
        return {name: ref for name, ref in refs.items() if ref is not None}

    def local_models(self) -> list[ChatModel]:
        """The model objects named here that only this process knows (``portable`` False)."""
        return [ref.resolve() for ref in self.model_refs().values() if not ref.portable]

    def keep_local_models(self, ctx: Any) -> None:
        """Keep ``local_models()`` alive as long as ``ctx`` (its node) lives: the registry
        holds them weakly, and the ctx cannot carry them (its attributes travel to
        workers)."""
        models = self.local_models()
        if models:
            _KEPT_MODELS[ctx] = models


# Each ctx's local model objects, dropped with the ctx (see keep_local_models).
_KEPT_MODELS: weakref.WeakKeyDictionary[Any, list[ChatModel]] = weakref.WeakKeyDictionary()


def _check_ref(value: Any, name: str, where: str) -> None:
    if not isinstance(value, ModelRef):
        raise TypeError(
            f"{where}: {name} must be a ModelRef (from_kwargs makes one of a spec or a "
            f"ChatModel), got {value!r:.80}"
        )
    if not isinstance(value.spec, str) or not value.spec.strip():
        raise ValueError(f"{where}: {name} must name a model, got spec {value.spec!r}")
    if value.base_url is not None and not isinstance(value.base_url, str):
        raise TypeError(f"{where}: base_url must be a str, got {value.base_url!r}")


@dataclass(frozen=True)
class LLMOptions(_CtxRecord):
    """The options of one LLM call (``LLMCall``, ``FormattedLLMCall``, ``ChatCall``),
    resolved: what its forward used and its backward will use.

    - ``model``: the forward's model (its ``base_url`` inside);
    - ``params``: the forward's model parameters;
    - ``feedback_model``: the backward's model (None: ``model``);
    - ``feedback_params``: the backward's parameters (None given: a copy of ``params``);
    - ``role``: the reply's role;
    - ``feedback_budget``: tokens of feedback before the backward condenses it (None: never);
    - ``response_format``: the JSON schema the reply follows (a dataclass or TypedDict
      given is turned into its schema), or None for text;
    - ``format_attempts``: replies asked for before ``StructuredOutputError``.

    ``where`` names the caller in error messages. ``LLMOptions.from_kwargs(function,
    kwargs)`` builds one from a call's keyword options (``KEYWORDS``), with the defaults.
    Raises ``TypeError`` / ``ValueError`` naming the option that is wrong.

    Example::

        options = LLMOptions.from_kwargs("llm_call", {"model": "simulated", "params": {"temperature": 0}})
        print(options.model.spec, options.params, options.feedback_budget)   # simulated {'temperature': 0} 4000
    """

    model: ModelRef
    params: Mapping[str, Any] = field(default_factory=dict)
    feedback_model: ModelRef | None = None
    feedback_params: Mapping[str, Any] | None = None
    role: str = OUTPUT_ROLE
    feedback_budget: int | None = DEFAULT_FEEDBACK_BUDGET
    response_format: dict[str, Any] | None = None
    format_attempts: int = DEFAULT_STRUCTURED_ATTEMPTS
    where: InitVar[str] = "LLMOptions"

    _MODEL_FIELDS: ClassVar[tuple[str, ...]] = ("model", "feedback_model")
    KEYWORDS: ClassVar[frozenset[str]]
    """The keyword options an LLM call takes: the fields, and ``base_url`` (which goes
    into ``model``)."""

    def __post_init__(self, where: str) -> None:
        _check_ref(self.model, "model", where)
        if self.feedback_model is not None:
            _check_ref(self.feedback_model, "feedback_model", where)
        params = _params(self.params, "params", where)
        feedback_params = (
            dict(params)
            if self.feedback_params is None
            else _params(self.feedback_params, "feedback_params", where)
        )
        if not isinstance(self.role, str):
            raise TypeError(f"{where}: role must be a str, got {self.role!r}")
        _check_budget(self.feedback_budget, where)
        attempts = self.format_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise TypeError(f"{where}: format_attempts must be an int >= 1, got {attempts!r}")
        schema = None if self.response_format is None else json_schema_of(self.response_format)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "feedback_params", feedback_params)
        object.__setattr__(self, "response_format", schema)

    @property
    def request_params(self) -> dict[str, Any]:
        """The backward's request parameters (a fresh dict)."""
        return dict(self.params if self.feedback_params is None else self.feedback_params)

    @classmethod
    def from_kwargs(cls, function: str, kwargs: Mapping[str, Any]) -> LLMOptions:
        """The options of a call to ``function`` given ``kwargs`` (names from ``KEYWORDS``;
        None counts as not given), the defaults filled in.

        Raises ``TypeError`` for an unknown name (naming the valid ones), a Variable as an
        option, a value of the wrong type, or no model given or set.
        """
        _check_given(function, kwargs, cls.KEYWORDS, unknown_are="keyword argument(s)")
        budget = _budget(function, kwargs)
        given = with_defaults(  # use_models / set_default_models; None dropped
            function, {k: v for k, v in kwargs.items() if k != "feedback_budget"}
        )
        base_url = given.pop("base_url", None)
        if base_url is not None and not isinstance(base_url, str):
            raise TypeError(f"{function}: base_url must be a str, got {base_url!r}")
        given["model"] = model_ref(given["model"], base_url)
        if "feedback_model" in given:
            given["feedback_model"] = model_ref(
                given["feedback_model"], None, what="feedback_model"
            )
        # Every other field as given, else its default: a field added to the record
        # reaches every call without another line here.
        return cls(**given, feedback_budget=budget, where=function)


LLMOptions.KEYWORDS = frozenset({f.name for f in dataclasses.fields(LLMOptions)} | {"base_url"})


class CallKeywords(TypedDict, total=False):
    """The keyword options of an LLM call but ``model``, typed for a signature's
    ``**options`` (``TextLoss`` takes ``model`` positionally too): see :class:`LLMKeywords`."""

    base_url: str | None
    params: Mapping[str, Any] | None
    feedback_model: ModelLike | None
    feedback_params: Mapping[str, Any] | None
    role: str | None
    feedback_budget: int | None
    response_format: Any
    format_attempts: int | None


class LLMKeywords(CallKeywords, total=False):
    """The keyword options of an LLM call, as ``llm_call``, ``formatted_llm_call`` and
    ``chat_call`` take them (``**options: Unpack[LLMKeywords]``), so a type checker checks
    each name and value at the call.

    The names are ``LLMOptions.KEYWORDS``, each field of :class:`LLMOptions` and
    ``base_url``; their types are what a caller passes (a model as a spec or a
    ``ChatModel``, a dataclass as ``response_format``), which ``LLMOptions.from_kwargs``
    resolves. None, or leaving a name out, means "not given" (the default), except for
    ``feedback_budget``, where None means "never condense". A test holds the names equal
    to the fields.
    """

    model: ModelLike | None


@dataclass(frozen=True)
class PythonCallOptions(_CtxRecord):
    """The options of one ``PythonCall``, resolved.

    - ``purpose``: what the function does, in words (the feedback model reads it);
    - ``role``: the output's role;
    - ``feedback_model`` / ``feedback_params``: the backward's model and parameters
      (None and ``{}`` when no input required grad: the backward then asks nothing);
    - ``feedback_budget``: as in :class:`LLMOptions`.
    """

    purpose: str
    role: str
    feedback_model: ModelRef | None = None
    feedback_params: Mapping[str, Any] = field(default_factory=dict)
    feedback_budget: int | None = DEFAULT_FEEDBACK_BUDGET
    where: InitVar[str] = "PythonCallOptions"

    _MODEL_FIELDS: ClassVar[tuple[str, ...]] = ("feedback_model",)
    KEYWORDS: ClassVar[frozenset[str]]
    """The keyword options ``PythonCall`` takes, its fields (its other keywords are named
    inputs)."""

    def __post_init__(self, where: str) -> None:
        if not isinstance(self.purpose, str) or not self.purpose.strip():
            raise TypeError(
                f"{where} needs purpose=: a sentence saying what the function does (the "
                f"feedback model reads it instead of the code), got {self.purpose!r:.80}"
            )
        if not isinstance(self.role, str):
            raise TypeError(f"{where}: role must be a str, got {self.role!r}")
        if self.feedback_model is not None:
            _check_ref(self.feedback_model, "feedback_model", where)
        _check_budget(self.feedback_budget, where)
        params = _params(self.feedback_params, "feedback_params", where)
        object.__setattr__(self, "feedback_params", params)

    @classmethod
    def from_kwargs(
        cls, function: str, kwargs: Mapping[str, Any], *, default_role: str, needs_feedback: bool
    ) -> PythonCallOptions:
        """The options of a ``PythonCall`` given ``kwargs`` (names from ``KEYWORDS``).

        ``function`` names the call in errors (``"PythonCall of parse()"``); ``role``
        defaults to ``default_role``; the feedback model and params (given, else the
        defaults of ``use_models`` / ``set_default_models``) are resolved only when
        ``needs_feedback``. Raises ``TypeError`` naming the option that is wrong.
        """
        _check_given(function, kwargs, cls.KEYWORDS, unknown_are="option(s)")
        options = cls(
            purpose=kwargs.get("purpose"),  # type: ignore[arg-type]  # the constructor checks it
            role=kwargs.get("role") or default_role,
            feedback_budget=_budget(function, kwargs),
            where=function,
        )
        if not needs_feedback:  # not recorded: no backward will ask a model
            return options
        model, base_url, params = feedback_defaults(
            "PythonCall", kwargs.get("feedback_model"), kwargs.get("feedback_params")
        )
        return dataclasses.replace(
            options,
            feedback_model=model_ref(model, base_url, what="feedback_model"),
            feedback_params=params,
            where=function,
        )


PythonCallOptions.KEYWORDS = frozenset(f.name for f in dataclasses.fields(PythonCallOptions))
