"""Default models, set once: ``use_models(...)`` for a block, ``set_default_models(...)`` for the process.

Text functions need a forward model and a feedback model (for their backward's
requests), and the optimizer a model for its updates. Rather than passing
``model=`` to every call (or TextGrad's global ``set_backward_engine``), set them
once. For every option, the first of these that sets it wins:

1. the argument given to the call (``model=``, ``feedback_model=``, ...; None
   counts as not given);
2. the innermost ``with use_models(...)`` around the call that sets it: a
   contextvar, so it holds for the current task and the tasks it starts, never
   for another coroutine on the same loop (like ``no_grad``);
3. ``set_default_models(...)``, the process default;
4. what happens without defaults: the feedback model is the call's model, the
   feedback params are its params, and a call without any model raises
   ``TypeError`` saying how to give one.

The options are ``model`` (with its ``base_url``, which only goes with the
model it was given with), ``params``, ``feedback_model`` and
``feedback_params``. ``TGD`` without ``model=`` uses the feedback model (its
``model_params`` default to the feedback params). Defaults are read when a
Function is applied (the forward) and stored in its node, so the backward uses
the models of the forward wherever it runs.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from asyncgraph._redact import redact_url
from asyncgraph.text._registry import ModelLike, model_ref

__all__ = [
    "ModelDefaults",
    "current_models",
    "feedback_defaults",
    "set_default_models",
    "use_models",
    "with_defaults",
]


@dataclass(frozen=True)
class ModelDefaults:
    """A set of default models and params; None means "not set here".

    ``current_models()`` returns the defaults in effect; ``use_models`` and
    ``set_default_models`` return the ones they set.
    """

    model: ModelLike | None = None
    base_url: str | None = None
    params: Mapping[str, Any] | None = field(default=None, hash=False)
    feedback_model: ModelLike | None = None
    feedback_params: Mapping[str, Any] | None = field(default=None, hash=False)

    def for_feedback(self) -> tuple[ModelLike | None, str | None, dict[str, Any]]:
        """The model (with its base_url) and params feedback requests use under these
        defaults: ``feedback_model``, else ``model``; ``feedback_params``, else ``params``,
        else ``{}``."""
        model: ModelLike | None
        if self.feedback_model is not None:
            model, base_url = self.feedback_model, None
        else:
            model, base_url = self.model, self.base_url
        params = self.feedback_params if self.feedback_params is not None else self.params
        return model, base_url, dict(params or {})

    def over(self, other: ModelDefaults) -> ModelDefaults:
        """These defaults, with ``other``'s where these are not set."""
        model, base_url = (
            (self.model, self.base_url) if self.model is not None else (other.model, other.base_url)
        )
        return ModelDefaults(
            model=model,
            base_url=base_url,
            params=self.params if self.params is not None else other.params,
            feedback_model=self.feedback_model
            if self.feedback_model is not None
            else other.feedback_model,
            feedback_params=self.feedback_params
            if self.feedback_params is not None
            else other.feedback_params,
        )


_EMPTY = ModelDefaults()
_SCOPE: contextvars.ContextVar[ModelDefaults] = contextvars.ContextVar(
    "asyncgraph_model_defaults", default=_EMPTY
)
_process_lock = threading.Lock()
_process = _EMPTY  # the process default: set_default_models, process-wide by design


def _params(value: Any, name: str, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{where}: {name} must be a dict of model parameters, got {value!r:.80}")
    return dict(value)


def _defaults(
    where: str,
    model: ModelLike | None,
    base_url: str | None,
    params: Mapping[str, Any] | None,
    feedback_model: ModelLike | None,
    feedback_params: Mapping[str, Any] | None,
) -> ModelDefaults:
    """Checked defaults: a bad model fails here, not at the first call that uses it."""
    if model is not None:
        model_ref(model, base_url)
    elif base_url is not None:
        raise ValueError(
            f"{where}: base_url={redact_url(base_url)!r} goes with a model spec; pass model= "
            f"too "
            f"(e.g. model='openai:gpt-4o-mini', base_url=...)"
        )
    if feedback_model is not None:
        model_ref(feedback_model, None, what="feedback_model")
    return ModelDefaults(
        model=model,
        base_url=base_url,
        params=_params(params, "params", where),
        feedback_model=feedback_model,
        feedback_params=_params(feedback_params, "feedback_params", where),
    )


@contextmanager
def use_models(
    model: ModelLike | None = None,
    *,
    base_url: str | None = None,
    params: Mapping[str, Any] | None = None,
    feedback_model: ModelLike | None = None,
    feedback_params: Mapping[str, Any] | None = None,
) -> Iterator[ModelDefaults]:
    """Default models for the text functions and optimizers used inside the block.

    Sets the options given (None leaves an option to the enclosing blocks and the
    process default) for the current task and the tasks it starts, until the
    block ends; yields the defaults now in effect. Models are specs, registered
    names or ChatModel objects, as ``model=`` takes (``TypeError`` / ``ValueError``
    for one that is not).

    Example::

        with use_models("openai:gpt-4o-mini", feedback_model="openai:gpt-4o"):
            answer = await llm_call(prompt, question)   # gpt-4o-mini; feedback from gpt-4o
            loss = await TextLoss("Is the answer right?")(answer)
            await loss.backward()
            await TGD([prompt]).step()                  # updates by gpt-4o
    """
    scoped = _defaults("use_models", model, base_url, params, feedback_model, feedback_params)
    token = _SCOPE.set(scoped.over(_SCOPE.get()))
    try:
        yield current_models()
    finally:
        _SCOPE.reset(token)


def set_default_models(
    model: ModelLike | None = None,
    *,
    base_url: str | None = None,
    params: Mapping[str, Any] | None = None,
    feedback_model: ModelLike | None = None,
    feedback_params: Mapping[str, Any] | None = None,
) -> ModelDefaults:
    """Set the process's default models (replacing all of them); returns the previous ones.

    ``set_default_models()`` with no arguments clears them. ``use_models`` blocks
    take precedence; see the module docstring for the order.

    Example::

        set_default_models("openai:gpt-4o-mini", params={"temperature": 0})
    """
    global _process
    new = _defaults("set_default_models", model, base_url, params, feedback_model, feedback_params)
    with _process_lock:
        previous, _process = _process, new
    return previous


def current_models() -> ModelDefaults:
    """The defaults in effect here: each option from the innermost ``use_models`` that
    sets it, else from ``set_default_models``, else None.

    Example::

        with use_models("openai:gpt-4o-mini", feedback_model="openai:gpt-4o"):
            defaults = current_models()
            print(defaults.model, defaults.feedback_model)    # openai:gpt-4o-mini openai:gpt-4o
    """
    with _process_lock:
        process = _process
    return _SCOPE.get().over(process)


def _no_model(function: str, what: str = "model") -> TypeError:
    return TypeError(
        f"{function} needs a {what} and none is set: pass {what.replace(' ', '_')}= (a spec such as "
        f"'openai:gpt-4o-mini' or 'simulated', a name given to asyncgraph.text.register_model, "
        f"or a ChatModel instance), or set a default with `with "
        f"asyncgraph.text.use_models(model=...):` (this task) or "
        f"asyncgraph.text.set_default_models(model=...) (the whole process)"
    )


def with_defaults(function: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """An LLM call's options with the defaults filled in where not given (None = not given).

    Raises ``TypeError`` when no model is given or set.
    """
    out = {key: value for key, value in options.items() if value is not None}
    defaults = current_models()
    if "model" not in out:
        if defaults.model is None:
            raise _no_model(function)
        out["model"] = defaults.model
        if "base_url" not in out and defaults.base_url is not None:
            out["base_url"] = defaults.base_url
    for name in ("params", "feedback_model", "feedback_params"):
        value = getattr(defaults, name)
        if name not in out and value is not None:
            out[name] = value
    return out


def feedback_defaults(
    function: str,
    feedback_model: ModelLike | None = None,
    feedback_params: Mapping[str, Any] | None = None,
) -> tuple[ModelLike, str | None, dict[str, Any]]:
    """The feedback model (with its base_url) and params for a function without a forward model.

    For a Function of your own whose backward asks a model: ``feedback_model``
    if given, else the default's (``current_models().for_feedback()``); params
    likewise. Call it in forward and keep the result in the ctx. Raises
    ``TypeError`` naming ``function`` when no model is given or set.

    Example::

        class Critique(Function):
            @staticmethod
            def forward(ctx, text, feedback_model=None):
                ctx.model, ctx.base_url, ctx.params = feedback_defaults("Critique", feedback_model)
                return Variable(text.data)
    """
    model, base_url, params = current_models().for_feedback()
    if feedback_model is not None:
        model, base_url = feedback_model, None
    if model is None:
        raise _no_model(function, "feedback model")
    if feedback_params is not None:
        params = dict(feedback_params)
    return model, base_url, params
