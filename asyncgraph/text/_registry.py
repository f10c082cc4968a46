"""Which model a text function calls, by name: the process-level model registry.

A ``ChatModel`` object cannot travel to a worker process, so text Functions keep
a *model reference* in their ctx: a spec string plus an optional ``base_url``,
both msgpack-friendly. Every process resolves a reference to a model of its own:

1. a name given to ``register_model(name, model)`` in this process resolves to
   that model (whatever ``base_url`` says);
2. otherwise ``asyncgraph.models.parse_model_spec(spec, base_url=base_url)``
   builds one (``"simulated"``, ``"simulated:0.05"``, ``"openai:gpt-4o-mini"``;
   API keys come from the process's environment, e.g. ``OPENAI_API_KEY``), and
   the process keeps it for the next call with the same spec and base_url.

Passing a model *instance* to a text function works too: it is registered under
a generated name (``"instance:SimulatedModel:7f3a..."``) that only this process
knows, so such a graph's backward runs in-process only. For a distributed
backward either pass a spec string, or register the instance under the same
name in the app and in every worker (``register_model("judge", model)``) and
pass ``model="judge"``.

The registry is process-wide on purpose (a worker serves many graphs with the
models it was configured with); it holds its models strongly until
``unregister_model``, which returns the model so its owner can ``aclose()`` it.
A model holds connections bound to the event loop that first used them, so
resolve specs within one long-lived loop (an app, a worker). It is
thread-safe.
"""

from __future__ import annotations

import threading
from typing import Any, TypeAlias

from asyncgraph.models import ChatModel, parse_model_spec
from asyncgraph.text._exceptions import UnknownModelError

__all__ = [
    "ModelLike",
    "ModelRef",
    "model_ref",
    "register_model",
    "resolve_model",
    "resolve_ref",
    "unregister_model",
]

ModelLike: TypeAlias = str | ChatModel
"""What text functions accept as ``model=``: a spec / registered name, or an instance."""

ModelRef: TypeAlias = dict[str, Any]
"""``{"spec": str, "base_url": str | None}``: a model reference as stored in a ctx."""

_INSTANCE_PREFIX = "instance:"

_lock = threading.Lock()
_named: dict[str, ChatModel] = {}
_built: dict[tuple[str, str | None], ChatModel] = {}
_instance_names: dict[int, str] = {}


def _check_model(model: Any, what: str) -> None:
    if not isinstance(model, ChatModel):
        raise TypeError(
            f"{what} must be a ChatModel (an object with `async complete(messages, **params)`), "
            f"got {type(model).__name__} ({model!r:.80})"
        )


def register_model(name: str, model: ChatModel) -> str:
    """Make ``name`` resolve to ``model`` in this process; returns ``name``.

    Registering a name again replaces its model. Use it in the app and in each
    worker (before it starts serving) to give a spec a process-specific
    configuration, e.g. ``register_model("openai:gpt-4o-mini",
    OpenAIChat("gpt-4o-mini", cache=RedisCache(url), rate_limit=...))``.
    Raises ``TypeError`` if ``model`` is not a ChatModel, ``ValueError`` for an
    empty name.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_model needs a non-empty str name, got {name!r}")
    _check_model(model, "register_model's model")
    with _lock:
        _named[name] = model
    return name


def unregister_model(name: str, base_url: str | None = None) -> ChatModel | None:
    """Forget ``name``; returns the model it named, if any (e.g. to ``await model.aclose()``).

    ``name`` may be a registered name, a generated instance name, or a spec this
    process built a model for (with the ``base_url`` it was resolved with); the
    next ``resolve_model`` of a forgotten spec builds a new model.
    """
    with _lock:
        model = _named.pop(name, None)
        if model is not None:
            if _instance_names.get(id(model)) == name:
                del _instance_names[id(model)]
            return model
        return _built.pop((name, base_url), None)


def resolve_model(spec: str, base_url: str | None = None) -> ChatModel:
    """The model ``spec`` names in this process (see the module docstring for the rules).

    Raises ``UnknownModelError`` when ``spec`` is neither registered nor a spec
    ``parse_model_spec`` understands, or names a model instance registered in
    another process.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a model spec is a str, got {type(spec).__name__} ({spec!r:.80})")
    with _lock:
        model = _named.get(spec)
        if model is not None:
            return model
        key = (spec, base_url)
        model = _built.get(key)
        if model is not None:
            return model
        if spec.startswith(_INSTANCE_PREFIX):
            raise UnknownModelError(
                f"model {spec!r} names a model instance registered in another process (or "
                f"unregistered since): instances cannot travel between processes. Pass a "
                f"spec string such as 'openai:gpt-4o-mini', or register the instance under "
                f"the same name in the app and in every worker with "
                f"asyncgraph.text.register_model(name, model) and pass model=name.",
                spec=spec,
                base_url=base_url,
            )
        try:
            model = parse_model_spec(spec, base_url=base_url)
        except ValueError as exc:
            known = sorted(n for n in _named if not n.startswith(_INSTANCE_PREFIX))
            raise UnknownModelError(
                f"unknown model {spec!r}: it is not registered in this process (registered: "
                f"{known!r}) and is not a model spec ({exc}). Register it with "
                f"asyncgraph.text.register_model({spec!r}, model) in this process (in "
                f"every worker too, for a distributed backward).",
                spec=spec,
                base_url=base_url,
            ) from exc
        _built[key] = model
        return model


def model_ref(model: ModelLike, base_url: str | None = None, *, what: str = "model") -> ModelRef:
    """The reference a ctx stores for ``model``; registers an instance under a generated name."""
    if isinstance(model, str):
        if not model.strip():
            raise ValueError(f"{what} must be a model spec or a ChatModel, got {model!r}")
        return {"spec": model, "base_url": base_url}
    _check_model(model, what)
    if base_url is not None:
        raise ValueError(
            f"{what}: base_url={base_url!r} goes with a spec string ('openai:MODEL'); "
            f"a model instance carries its own base_url"
        )
    with _lock:
        name = _instance_names.get(id(model))
        if name is None or _named.get(name) is not model:
            name = f"{_INSTANCE_PREFIX}{type(model).__name__}:{id(model):x}"
            _named[name] = model
            _instance_names[id(model)] = name
    return {"spec": name, "base_url": None}


def resolve_ref(ref: ModelRef) -> ChatModel:
    """``resolve_model`` for a reference read back from a ctx (possibly after msgpack)."""
    spec = ref.get("spec") if isinstance(ref, dict) else None
    if not isinstance(spec, str):
        raise TypeError(f"malformed model reference {ref!r}: expected {{'spec': str, 'base_url': ...}}")
    base_url = ref.get("base_url")
    return resolve_model(spec, base_url if isinstance(base_url, str) else None)
