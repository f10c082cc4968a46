"""Which model a text function calls, by name: the process-level model registry.

A ``ChatModel`` object cannot travel to a worker process, so text Functions keep
a *model reference* in their ctx (:class:`ModelRef`: a spec string plus an
optional ``base_url``, stored as plain data). Every process resolves a reference
to a model of its own:

1. a name given to ``register_model(name, model)`` in this process resolves to
   that model (whatever ``base_url`` says);
2. otherwise ``asyncgraph.models.parse_model_spec(spec, base_url=base_url)``
   builds one (``"simulated"``, ``"simulated:0.05"``, ``"openai:gpt-4o-mini"``;
   API keys, rate limit and cache come from the process's environment:
   ``OPENAI_API_KEY``, ``ASYNCGRAPH_MODEL_RPM`` / ``_TPM`` / ``_RATE_REDIS`` /
   ``_CACHE``), and the process keeps it for the next call with the same spec
   and base_url. A worker only accepts a ``base_url`` that its operator allows
   (``asyncgraph worker --allow-base-url``; see ``asyncgraph.models._spec``):
   any other raises ``ModelConfigError`` naming the URL.

**Distributed backward: pass a spec string, not a model object.** Passing a
model *instance* to a text function works in-process: it is registered under a
generated name (``"instance:SimulatedModel:7f3a..."``) that only this process
knows, so its ``ModelRef.portable`` is False and a worker cannot resolve it
(``UnknownModelError`` from the worker). For a distributed backward either pass
a spec string (``model="openai:gpt-4o-mini"``, with ``base_url=``), or register
the model under the same name in the app and in every worker
(``register_model("judge", model)`` in a module the worker imports with
``asyncgraph worker --import your_module``) and pass ``model="judge"``.
``check_portable(loss)`` finds the remote nodes of a graph that name an
instance before a distributed backward starts.

Registered names are held strongly until ``unregister_model``, which returns the
model so its owner can ``aclose()`` it; so are the models built from specs.
Instance registrations are weak: they last as long as the model object does
(the caller, a graph node or a ``TextLoss`` using it keeps it alive). An
``OpenAIChat`` serves any number of event loops (one connection pool per loop),
so a model resolved once per process works across ``anyio.run`` calls. The
registry is thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, TypeAlias

from asyncgraph._exceptions import UnknownModelError
from asyncgraph._redact import redact, redact_url
from asyncgraph.models import ChatModel, ModelConfigError, check_base_url, parse_model_spec

__all__ = [
    "ModelLike",
    "ModelRef",
    "RefData",
    "model_ref",
    "register_model",
    "resolve_model",
    "resolve_ref",
    "unregister_model",
]

ModelLike: TypeAlias = str | ChatModel
"""What text functions accept as ``model=``: a spec / registered name, or an instance."""

RefData: TypeAlias = dict[str, Any]
"""``{"spec": str, "base_url": str | None}``: a ``ModelRef`` as stored in a ctx."""

INSTANCE_PREFIX = "instance:"

_HOW_TO_SHARE = (
    "pass model= a spec string such as 'openai:gpt-4o-mini' (with base_url= for your "
    "server) or 'simulated', which every process builds for itself; or register the model "
    "under one name in the app and in every worker with asyncgraph.text.register_model(name, "
    "model), in a module the worker imports (asyncgraph worker --import your_module), and "
    "pass model=name"
)


@dataclass(frozen=True)
class ModelRef:
    """How a text Function names its model: ``spec`` plus ``base_url``, plain data.

    ``portable`` says whether another process (a worker) can resolve it: True for a
    spec string or a name given to ``register_model`` (which the worker must register
    too), False for a model object passed directly, which is known here only under a
    generated ``"instance:..."`` name. ``ModelRef.of(model, base_url)`` makes the
    reference a text function stores for its ``model=`` argument; ``resolve()`` returns
    this process's model for it; ``to_data()`` / ``from_data()`` convert to and from the
    dict a ctx stores.

    Example::

        ModelRef.of("openai:gpt-4o-mini").portable   # True: every process can build it
        ModelRef.of(SimulatedModel()).portable       # False: local backward only
    """

    spec: str
    base_url: str | None = None

    def __repr__(self) -> str:
        shown = None if self.base_url is None else redact_url(self.base_url)
        return f"ModelRef(spec={self.spec!r}, base_url={shown!r})"

    @classmethod
    def of(cls, model: ModelLike, base_url: str | None = None) -> ModelRef:
        """The reference for ``model`` (a spec, a registered name or a ChatModel object)."""
        return model_ref(model, base_url)

    @property
    def portable(self) -> bool:
        return not self.spec.startswith(INSTANCE_PREFIX)

    def resolve(self) -> ChatModel:
        return resolve_model(self.spec, self.base_url)

    def to_data(self) -> RefData:
        return {"spec": self.spec, "base_url": self.base_url}

    @classmethod
    def from_data(cls, data: Any) -> ModelRef:
        """The reference stored by ``to_data()`` (also after msgpack); ``TypeError`` if malformed."""
        spec = data.get("spec") if isinstance(data, dict) else None
        base_url = data.get("base_url") if isinstance(data, dict) else None
        if not isinstance(spec, str) or not (base_url is None or isinstance(base_url, str)):
            raise TypeError(
                f"malformed model reference {redact(repr(data))}: expected {{'spec': str, 'base_url': "
                f"str | None}}"
            )
        return cls(spec, base_url)


_lock = threading.Lock()
_named: dict[str, ChatModel] = {}
_built: dict[tuple[str, str | None], ChatModel] = {}
# Models passed as objects: weak, so the registry never keeps one alive by itself.
_instances: weakref.WeakValueDictionary[str, ChatModel] = weakref.WeakValueDictionary()
_unweakrefable: dict[str, ChatModel] = {}  # instances that do not support weak references


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

    Example::

        register_model("house-model", OpenAIChat("gpt-4o-mini", cache=DiskCache(".cache")))
        answer = await llm_call(prompt, question, model="house-model")
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

    Example::

        register_model("house-model", SimulatedModel())
        model = unregister_model("house-model")     # the SimulatedModel; the name is free again
        await model.aclose()
    """
    with _lock:
        for table in (_named, _instances, _unweakrefable):
            model = table.pop(name, None)
            if model is not None:
                return model
        return _built.pop((name, base_url), None)


def resolve_model(spec: str, base_url: str | None = None) -> ChatModel:
    """The model ``spec`` names in this process (see the module docstring for the rules).

    Raises ``UnknownModelError`` when ``spec`` is neither registered nor a spec
    ``parse_model_spec`` understands, or names a model instance of another process;
    ``asyncgraph.models.ModelConfigError`` when the environment's model settings
    (``ASYNCGRAPH_MODEL_*``) are invalid.

    Example::

        model = resolve_model("simulated")          # a SimulatedModel, built once per process
        print(resolve_model("simulated") is model)    # True
    """
    if not isinstance(spec, str):
        raise TypeError(f"a model spec is a str, got {type(spec).__name__} ({spec!r:.80})")
    with _lock:
        for table in (_named, _instances, _unweakrefable):
            model = table.get(spec)
            if model is not None:
                return model
        # A worker allows only some base URLs (its API key goes there): checked before
        # the cache too, as a model built earlier may predate the restriction.
        check_base_url(base_url)
        key = (spec, base_url)
        model = _built.get(key)
        if model is not None:
            return model
        if spec.startswith(INSTANCE_PREFIX):
            raise UnknownModelError(
                f"model {spec!r} is not known in this process: it is the generated name of a "
                f"model object that was passed to a text function in another process (or "
                f"that no longer exists), and model objects cannot travel between "
                f"processes. To run this backward on workers, {_HOW_TO_SHARE}.",
                spec=spec,
                base_url=base_url,
            )
        try:
            model = parse_model_spec(spec, base_url=base_url)
        except ModelConfigError:
            raise
        except ValueError as exc:
            known = sorted(_named)
            # The spec's own error leads: it says the fix (e.g. "write
            # 'openai:gpt-4o-mini'"); a name of the user's own comes second.
            raise UnknownModelError(
                f"{str(exc).rstrip('.')}. If {spec!r} is a name of your own, it is not "
                f"registered in this process (registered: {known!r}): register it with "
                f"asyncgraph.text.register_model({spec!r}, model) in this process; for a "
                f"distributed backward, in every worker too, from a module the worker "
                f"imports (asyncgraph worker --import your_module).",
                spec=spec,
                base_url=base_url,
            ) from exc
        _built[key] = model
        return model


def model_ref(model: ModelLike, base_url: str | None = None, *, what: str = "model") -> ModelRef:
    """The reference for ``model``: a spec as is, an instance under a generated name.

    An instance is registered (weakly) under ``"instance:<type>:<id>"``, the same name
    each time; its reference is not ``portable``.
    """
    if isinstance(model, str):
        if not model.strip():
            raise ValueError(f"{what} must be a model spec or a ChatModel, got {model!r}")
        return ModelRef(model, base_url)
    _check_model(model, what)
    if base_url is not None:
        raise ValueError(
            f"{what}: base_url={redact_url(base_url)!r} goes with a spec string "
            f"('openai:MODEL'); "
            f"a model instance carries its own base_url"
        )
    name = f"{INSTANCE_PREFIX}{type(model).__name__}:{id(model):x}"
    with _lock:
        if _instances.get(name) is not model and _unweakrefable.get(name) is not model:
            try:
                _instances[name] = model
            except TypeError:  # no __weakref__ slot: held until unregister_model
                _unweakrefable[name] = model
    return ModelRef(name)


def resolve_ref(data: Any) -> ChatModel:
    """``resolve_model`` for a reference read back from a ctx (possibly after msgpack)."""
    return ModelRef.from_data(data).resolve()
