"""The models a job can reach, found without running anything: what the cost cap checks
for prices before the job's first call (``_spending.check_priced``), and a name that
names no model is reported before it (``check_model_specs``).

They are looked for in:

- the optimizer (``TGD(model=...)``);
- the Module given as ``parameters``, and every Module found below, all the way down;
- the job's ``forward``: the object it is (a Module, a callable object) or is bound to,
  the variables its code refers to (``inspect.getclosurevars``: nonlocals and globals),
  and the ``model=`` / ``feedback_model=`` keywords written in its source
  (``model="openai:gpt-4o-mini"``, or a variable);
- the default models (``use_models`` / ``set_default_models``), which every text
  Function without a model of its own uses, and ``TGD`` without ``model=``.

A value there is a model when it is a ``ChatModel`` object, or a str under a name that
says so (``model``, ``feedback_model``, ``JUDGE_MODEL``, ``models``: the name is
``model(s)`` or ends with ``_model(s)``), or given as such a keyword; a str is resolved as
``model="..."`` is (``asyncgraph.text.resolve_model``, with the ``base_url`` beside it),
and one that does not resolve is left for its call to report. Other objects and functions
found there are searched one level further (their attributes; their variables and
keywords); a list, tuple or dict, for its items.

What cannot be seen this way: a model built or named while the job runs (inside
``forward``, from the data, two functions away from ``forward``). The cap's check of
every call stays for those.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgraph import Module
from asyncgraph.models import ChatModel, ModelConfigError
from asyncgraph.text import UnknownModelError, current_models, resolve_model

__all__ = ["ReachedModel", "check_model_specs", "reachable_models"]

_KEYWORDS = ("model", "feedback_model")  # the keywords of text Functions that name a model
_MAX_ITEMS = 1000  # of a list, tuple or dict searched


@dataclass(frozen=True)
class ReachedModel:
    """A model the job can reach: ``where`` it was found (``"optimizer.model"``,
    ``"forward's global JUDGE_MODEL"``), the ``model`` (resolved from a name when it was
    given as one), and the ``name`` it was given by (None for an object)."""

    where: str
    model: ChatModel
    name: str | None = None


def reachable_models(
    optimizer: Any, parameters: Any, forward: Callable[..., Any]
) -> list[ReachedModel]:
    """The models the job made of these can reach (see the module docstring), each once."""
    return _search(optimizer, parameters, forward).found


def check_model_specs(optimizer: Any, parameters: Any, forward: Callable[..., Any]) -> None:
    """Raise the ``UnknownModelError`` of the first model name the job can reach that
    names no model here (not registered, and not a spec: e.g. ``"gpt-4o-mini"`` for
    ``"openai:gpt-4o-mini"``), before its first call or file: its message leads with the
    fix, then says where the name was found. Names its search cannot see are left to
    their calls, as before."""
    for where, error in _search(optimizer, parameters, forward).unknown:
        raise UnknownModelError(
            f"{error} (found at {where}, checked before the job's first call)",
            spec=error.spec,
            base_url=error.base_url,
        ) from error


def _search(optimizer: Any, parameters: Any, forward: Callable[..., Any]) -> _Search:
    search = _Search()
    search.object(optimizer, "optimizer", depth=1)
    if isinstance(parameters, Module):
        search.module(parameters, "parameters")
    search.callable(forward, "forward")
    defaults = current_models()
    search.value(defaults.model, "the default model", "model", defaults.base_url, depth=0)
    search.value(defaults.feedback_model, "the default feedback model", "model", None, depth=0)
    return search


def _model_name(name: str) -> bool:
    name = name.lower()
    return any(name == word or name.endswith("_" + word) for word in ("model", "models"))


def _is_model(value: Any) -> bool:
    return isinstance(value, ChatModel) and not isinstance(value, type)


class _Search:
    def __init__(self) -> None:
        self.found: list[ReachedModel] = []
        self.unknown: list[tuple[str, UnknownModelError]] = []  # names that name no model
        self._models: set[int] = set()
        self._seen: set[int] = set()  # objects and functions searched

    def add(self, where: str, model: ChatModel, name: str | None) -> None:
        if id(model) not in self._models:
            self._models.add(id(model))
            self.found.append(ReachedModel(where, model, name))

    def value(self, value: Any, where: str, name: str, base_url: Any, *, depth: int) -> None:
        """``value``, found ``where`` under ``name`` (``base_url``: the one beside it)."""
        if _is_model(value):
            self.add(where, value, None)
        elif isinstance(value, str):
            if _model_name(name):
                self.spec(value, where, base_url)
        elif isinstance(value, Module):
            self.module(value, where)
        elif depth <= 0:
            return
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value[:_MAX_ITEMS]):
                self.value(item, f"{where}[{i}]", name, None, depth=depth - 1)
        elif isinstance(value, Mapping) and not isinstance(value, types.MappingProxyType):
            for key, item in list(value.items())[:_MAX_ITEMS]:
                self.value(item, f"{where}[{key!r}]", name, None, depth=depth - 1)
        elif inspect.isfunction(value) or inspect.ismethod(value):
            self.callable(value, where, depth=depth - 1)
        else:
            self.object(value, where, depth=depth - 1)

    def spec(self, spec: str, where: str, base_url: Any) -> None:
        try:
            model = resolve_model(spec, base_url if isinstance(base_url, str) else None)
        except UnknownModelError as exc:
            self.unknown.append((where, exc))  # neither registered nor a spec
            return
        except (ModelConfigError, TypeError, ValueError):
            return  # e.g. a missing API key: its call reports it (a worker may have one)
        self.add(where, model, spec)

    def object(self, value: Any, where: str, *, depth: int) -> None:
        """The attributes of an object (not of a class, a module or a function)."""
        attributes = getattr(value, "__dict__", None)
        if (
            id(value) in self._seen
            or not isinstance(attributes, dict)
            or isinstance(value, (type, types.ModuleType))
        ):
            return
        self._seen.add(id(value))
        for name, item in _attributes(attributes):
            at = f"{where}.{name}"
            self.value(item, at, name, attributes.get("base_url"), depth=depth)

    def module(self, module: Module, where: str) -> None:
        """A Module and its submodules (each an object), and their forward methods."""
        if id(module) in self._seen:
            return
        for name, sub in module.named_modules():
            at = f"{where}.{name}" if name else where
            self.object(sub, at, depth=1)
            forward = getattr(type(sub), "forward", None)
            if inspect.isfunction(forward):
                self.callable(forward, f"{type(sub).__name__}.forward", depth=0)

    def callable(self, fn: Any, where: str, *, depth: int = 1) -> None:
        """A callable: its object (``self`` of a method, a callable object or Module), and
        for a function its variables and the model keywords in its source."""
        if inspect.ismethod(fn):
            self.value(fn.__self__, f"{where}'s object", "self", None, depth=depth)
            fn = fn.__func__
        if not inspect.isfunction(fn):
            self.value(fn, where, "forward", None, depth=depth + 1)
            return
        # asyncgraph's own functions (llm_call, ...) hold no model of the job's.
        if id(fn) in self._seen or (fn.__module__ or "").split(".")[0] == "asyncgraph":
            return
        self._seen.add(id(fn))
        try:
            names = inspect.getclosurevars(fn)
        except (TypeError, ValueError):
            return
        for kind, found in (("global", names.globals), ("variable", names.nonlocals)):
            for name, item in found.items():
                self.value(item, f"{where}'s {kind} {name}", name, None, depth=depth)
        # Names used only in a nested scope (a comprehension) are not closure variables.
        variables = {**fn.__globals__, **names.globals, **names.nonlocals}
        missing = object()

        def known(node: ast.expr | None) -> Any:
            """A constant's value, a variable's, or ``missing``."""
            if isinstance(node, ast.Constant):
                return node.value
            if isinstance(node, ast.Name):
                return variables.get(node.id, missing)
            return missing

        for keyword, node, url in _keywords(fn):
            value, base_url = known(node), known(url)
            if value is not missing:
                at = f"{where}'s {keyword}= argument"
                self.value(value, at, keyword, None if base_url is missing else base_url, depth=0)


def _attributes(attributes: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, item in list(attributes.items()):
        if name not in ("_parameters", "_modules"):  # a Module's registries: named_modules
            yield name, item


def _keywords(fn: types.FunctionType) -> list[tuple[str, ast.expr, ast.expr | None]]:
    """The ``model=`` / ``feedback_model=`` keywords of the calls in ``fn``'s source, each
    with the ``base_url=`` of the same call (``model=`` only); none when its source cannot
    be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            given = {k.arg: k.value for k in node.keywords if k.arg is not None}
            for keyword in _KEYWORDS:
                if keyword in given:
                    url = given.get("base_url") if keyword == "model" else None
                    found.append((keyword, given[keyword], url))
    return found
