"""``Module``: a program of Parameters and sub-Modules, shaped like ``torch.nn.Module``.

Parameters and Modules assigned as attributes are registered, in assignment
order; ``named_parameters()`` names them with dotted paths (``"solver.prompt"``),
and ``state_dict()`` / ``load_state_dict()`` / ``save()`` / ``load()`` move their
values as JSON data. A Module's structure is its code: what is saved is only the
parameters' values, loaded back into a Module built by the same code.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from asyncgraph._files import write_private_json
from asyncgraph._values import from_json, to_json

from ._module_hooks import ModuleHooks
from ._variable import Parameter

__all__ = ["IncompatibleKeys", "Module"]

FORMAT = "asyncgraph-module"
VERSION = 1


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(..., strict=False)`` could not match, by dotted name."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _check_name(owner: Module, name: Any, what: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a str, got {name!r}")
    if not name or "." in name:
        raise KeyError(f"{what} name must be non-empty and contain no '.', got {name!r}")
    if hasattr(type(owner), name):
        raise KeyError(
            f"{what} name {name!r} is taken by an attribute of {type(owner).__name__}; pick "
            f"another name"
        )


class Module(ModuleHooks):
    """Base class of programs made of Parameters (prompts, numbers) and other Modules.

    Subclass it, call ``super().__init__()`` first, assign Parameters and
    Modules as attributes (they are registered in assignment order), and define
    ``async def forward(...)``; ``await module(...)`` runs it. Anything else
    assigned (a ``TextLoss``, a model spec, a plain ``Variable``) is an
    ordinary attribute, not part of the state.

    - ``parameters()`` / ``named_parameters()``: every Parameter, depth first
      (this Module's own first, then each sub-Module's), each once, named by
      dotted path (``"solver.prompt"``); ``children()`` / ``named_children()``,
      ``modules()`` / ``named_modules()`` likewise. Pass them to an optimizer:
      ``TGD(program.parameters())``.
    - ``state_dict()``: ``{dotted name: data}``, JSON data (numpy arrays as
      nested lists), copied. ``load_state_dict(state, strict=True)`` puts values
      back: with ``strict=True`` a missing or unexpected name raises
      ``KeyError``; with ``strict=False`` they are skipped and returned as
      ``IncompatibleKeys(missing_keys, unexpected_keys)`` (PyTorch's contract).
      A value that does not fit its parameter (text for a number, an array of
      another shape) raises ``ValueError`` either way. Nothing changes unless
      everything fits.
    - ``save(path)`` writes the state as JSON (atomically); ``load(path,
      strict=True)`` reads it into this Module (built by the same code).
    - ``zero_grad()`` clears every parameter's ``.grad``.
    - Hooks, as PyTorch's: ``register_forward_pre_hook(hook)`` (``hook(module, args)``
      before ``forward``), ``register_forward_hook(hook)`` (``hook(module, args,
      output)`` after it), ``register_full_backward_pre_hook(hook)`` (``hook(module,
      grad_output)``) and ``register_full_backward_hook(hook)`` (``hook(module,
      grad_input, grad_output)`` once the gradients of a call's inputs are known). A value
      a hook returns replaces what it was given; hooks may be ``async def``; each
      registration returns a handle whose ``remove()`` unregisters it.

    Assigning something else to a name that holds a Parameter (or a Module)
    raises ``TypeError``: to change a prompt, set ``module.prompt.data``.

    Example::

        class Pipeline(Module):
            def __init__(self):
                super().__init__()
                self.prompt = Parameter("Answer the question.", role="system prompt")

            async def forward(self, question):
                return await llm_call(self.prompt, question, model="simulated")

        program = Pipeline()
        answer = await program(Variable("6 * 7?", role="question"))
        program.save("program.json")
    """

    _parameters: dict[str, Parameter | None]
    _modules: dict[str, Module | None]

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})

    # -- registration ---------------------------------------------------------------
    def _registries(self) -> tuple[dict[str, Parameter | None], dict[str, Module | None]]:
        try:
            return self.__dict__["_parameters"], self.__dict__["_modules"]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__}: assign Parameters and Modules after calling "
                f"super().__init__() in __init__"
            ) from None

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` under ``name`` (``self.name = param`` does the same).

        None registers the name without a value (skipped by ``parameters()`` and
        ``state_dict()``). Raises ``TypeError`` for anything but a Parameter.
        """
        params, modules = self._registries()
        _check_name(self, name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot register {type(param).__name__} ({param!r:.60}) as parameter {name!r} "
                f"of {type(self).__name__}: it must be a Parameter or None"
            )
        self.__dict__.pop(name, None)
        modules.pop(name, None)
        params[name] = param

    def register_module(self, name: str, module: Module | None) -> None:
        """Register a sub-Module under ``name`` (``self.name = module`` does the same)."""
        params, modules = self._registries()
        _check_name(self, name, "module")
        if module is not None and not isinstance(module, Module):
            raise TypeError(
                f"cannot register {type(module).__name__} ({module!r:.60}) as sub-module "
                f"{name!r} of {type(self).__name__}: it must be a Module or None"
            )
        self.__dict__.pop(name, None)
        params.pop(name, None)
        modules[name] = module

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self.register_parameter(name, value)
            return
        if isinstance(value, Module):
            self.register_module(name, value)
            return
        registries = self.__dict__.get("_parameters"), self.__dict__.get("_modules")
        for registry, what in zip(registries, ("a Parameter", "a Module"), strict=True):
            if registry is not None and name in registry:
                if value is not None:
                    raise TypeError(
                        f"cannot assign {type(value).__name__} ({value!r:.60}) to "
                        f"{type(self).__name__}.{name}, which holds {what}: assign {what} or "
                        f"None (to change a parameter's value, set .{name}.data)"
                    )
                registry[name] = None
                return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: registered names live in the registries.
        registries = self.__dict__.get("_parameters"), self.__dict__.get("_modules")
        for registry in registries:
            if registry is not None and name in registry:
                return registry[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for registry in (self.__dict__.get("_parameters"), self.__dict__.get("_modules")):
            if registry is not None and name in registry:
                del registry[name]
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._parameters, *self._modules})

    # -- traversal ------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Direct sub-Modules with their names, in assignment order, each once."""
        seen: set[int] = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator[Module]:
        for _, module in self.named_children():
            yield module

    def clone(self, memo: dict[int, Any] | None = None) -> Module:
        """A copy with fresh Parameters (same values, roles and ``requires_grad``) and
        sub-Modules cloned likewise; every other attribute (models, losses, settings) is
        shared. A Parameter or Module reached twice is cloned once (``memo``).

        Example::

            draft = program.clone()        # change draft's prompts; program's stay
        """
        memo = {} if memo is None else memo
        done = memo.get(id(self))
        if done is not None:
            return done  # type: ignore[no-any-return]
        new = copy.copy(self)
        memo[id(self)] = new
        params: dict[str, Parameter | None] = {}
        modules: dict[str, Module | None] = {}
        object.__setattr__(new, "_parameters", params)
        object.__setattr__(new, "_modules", modules)
        for name, param in self._parameters.items():
            if param is None:
                params[name] = None
                continue
            twin = memo.get(id(param))
            if twin is None:
                twin = Parameter(
                    copy.deepcopy(param.data), role=param.role, requires_grad=param.requires_grad
                )
                memo[id(param)] = twin
            params[name] = twin
        for name, child in self._modules.items():
            modules[name] = None if child is None else child.clone(memo)
        return new

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This Module (named ``prefix``, ``""`` by default) and every sub-Module, depth first."""
        seen: set[int] = set()
        stack: list[tuple[str, Module]] = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            children = [
                (f"{name}.{child_name}" if name else child_name, child)
                for child_name, child in module._modules.items()
                if child is not None
            ]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        for _, module in self.named_modules():
            yield module

    def named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """Every Parameter with its dotted name, each Parameter once (its first name)."""
        seen: set[int] = set()
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for module_name, module in modules:
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                yield (f"{module_name}.{name}" if module_name else name), param

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def _state_items(self) -> Iterator[tuple[str, Parameter]]:
        """Every (name, Parameter), a Parameter shared under two names listed under both."""
        for module_name, module in self._named_modules_all():
            for name, param in module._parameters.items():
                if param is not None:
                    yield (f"{module_name}.{name}" if module_name else name), param

    def _named_modules_all(self) -> Iterator[tuple[str, Module]]:
        # Like named_modules, but a Module reached under two names is listed under both
        # (as PyTorch's state_dict does); a cycle is an error.
        def walk(name: str, module: Module, path: tuple[int, ...]) -> Iterator[tuple[str, Module]]:
            if id(module) in path:
                raise ValueError(f"{type(self).__name__} contains itself at {name!r}")
            yield name, module
            for child_name, child in module._modules.items():
                if child is not None:
                    full = f"{name}.{child_name}" if name else child_name
                    yield from walk(full, child, (*path, id(module)))

        yield from walk("", self, ())

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{dotted name: data}`` for every parameter, JSON data, copied."""
        return {name: copy.deepcopy(to_json(param.data)) for name, param in self._state_items()}

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> IncompatibleKeys:
        """Put ``state_dict``'s values into the parameters; see the class docstring."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict expects a mapping of dotted names to values (as made by "
                f"state_dict()), got {type(state_dict).__name__} ({state_dict!r:.80})"
            )
        items = list(self._state_items())
        names = [name for name, _ in items]
        known = set(names)
        missing = [name for name in names if name not in state_dict]
        unexpected = [key for key in state_dict if key not in known]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing: {missing!r}")
            if unexpected:
                parts.append(f"unexpected: {unexpected!r}")
            raise KeyError(
                f"the state does not match {type(self).__name__}'s parameters ({'; '.join(parts)}). "
                f"It was saved from a Module with other parameters: load it into the same "
                f"Module class, or pass strict=False to load the names that match"
            )
        values: list[tuple[Parameter, Any]] = []
        for name, param in items:
            if name not in state_dict:
                continue
            try:
                values.append((param, from_json(param.data, state_dict[name])))
            except RecursionError:  # copying a value nested deeper than Python recurses
                raise ValueError(
                    f"cannot load {name!r} into {type(self).__name__}: the saved value is "
                    f"nested too deeply"
                ) from None
            except ValueError as exc:
                raise ValueError(
                    f"cannot load {name!r} into {type(self).__name__}: the saved value "
                    f"{state_dict[name]!r:.60} is {exc}"
                ) from None
        for param, value in values:
            param.data = value
        return IncompatibleKeys(missing, unexpected)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path`` as JSON, atomically (a crash leaves the old
        file), as every file asyncgraph writes: mode 0600, its strings redacted (a prompt
        quoting an API key keeps ``[redacted]`` in its place)."""
        target = Path(path)
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "module": f"{type(self).__module__}.{type(self).__qualname__}",
            "state_dict": self.state_dict(),
        }
        write_private_json(target, payload, indent=1, repr_unknown=False)

    def load(self, path: str | os.PathLike[str], strict: bool = True) -> IncompatibleKeys:
        """Load a file written by ``save()`` into this Module; see ``load_state_dict``.

        Raises ``ValueError`` when the file is not JSON or not a saved Module.
        """
        source = Path(path)
        try:
            payload = json.loads(source.read_text(encoding="utf-8"))
        except RecursionError:  # json nests by recursion: "[[[[..." of any depth
            raise ValueError(
                f"{str(source)!r} is not a saved Module (not JSON: nested too deeply)"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{str(source)!r} is not a saved Module (not JSON: {exc})") from None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError(
                f"{str(source)!r} is not a saved Module (no {FORMAT!r} marker); write it with "
                f"module.save(path)"
            )
        if payload.get("version") != VERSION:
            raise ValueError(
                f"{str(source)!r} is a saved Module of version {payload.get('version')!r}; this "
                f"asyncgraph reads version {VERSION}"
            )
        state = payload.get("state_dict")
        if not isinstance(state, dict):
            raise ValueError(f"{str(source)!r} is corrupt: 'state_dict' is not a map")
        return self.load_state_dict(state, strict=strict)

    def zero_grad(self) -> None:
        """Forget every parameter's gradient (``.grad = None``)."""
        for param in self.parameters():
            param.grad = None

    # -- running ----------------------------------------------------------------------
    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What the Module computes; subclasses define it (usually ``async def``)."""
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``await module(...)``: run ``forward`` (sync or async), with the Module's hooks."""
        if self._has_hooks():
            return await self._call_with_hooks(args, kwargs)
        result = self.forward(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for name, param in self._parameters.items():
            lines.append(f"  ({name}): {param!r}")
        for name, module in self._modules.items():
            inner = repr(module).replace("\n", "\n  ")
            lines.append(f"  ({name}): {inner}")
        if len(lines) == 1:
            return f"{type(self).__name__}()"
        return "\n".join([*lines, ")"])
