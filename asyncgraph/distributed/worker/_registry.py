"""The names a worker serves: remote Functions of the modules given with ``--import``.

A task names its function; the worker looks that name up in this dict and
nowhere else. Nothing named by a message is ever imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncgraph import Function
from asyncgraph.distributed.wire._payload import fingerprint, remote_name

__all__ = ["Registry", "RegisteredFunction", "build_registry"]


@dataclass(frozen=True, slots=True)
class RegisteredFunction:
    name: str
    function: type[Function]
    fingerprint: str
    async_backward: bool = field(init=False)  # looked up once, not around every task

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "async_backward", inspect.iscoroutinefunction(self.function.backward)
        )


Registry = dict[str, RegisteredFunction]
"""What a ``Worker`` serves: each remote Function under its remote name.

Example::

    registry = build_registry(["myfunctions"])     # a Registry
    worker = Worker(WorkerConfig(redis_url=url), registry)
"""


def _subclasses(cls: type[Function]) -> Iterable[type[Function]]:
    stack = list(cls.__subclasses__())
    seen: set[type[Function]] = set()
    while stack:
        sub = stack.pop()
        if sub in seen:
            continue
        seen.add(sub)
        yield sub
        stack.extend(sub.__subclasses__())


def build_registry(modules: Iterable[str]) -> Registry:
    """Import ``modules`` and register their Function subclasses with ``dispatch == "remote"``.

    Only classes defined in those modules (``cls.__module__``) count, so a module
    that imports a remote Function from elsewhere does not serve it twice.
    Raises ``ImportError`` for a module that cannot be imported and
    ``ValueError`` when two functions share a name or a module serves none.

    Example::

        registry = build_registry(["asyncgraph.text"])
        print(sorted(registry))     # ['asyncgraph.text.ChatCall', 'asyncgraph.text.FormattedLLMCall', ...]
    """
    names = list(dict.fromkeys(modules))
    for module_name in names:
        importlib.import_module(module_name)
    registry: Registry = {}
    wanted = set(names)
    for cls in _subclasses(Function):
        if cls.__module__ not in wanted or cls.dispatch != "remote" or inspect.isabstract(cls):
            continue
        name = remote_name(cls)
        other = registry.get(name)
        if other is not None and other.function is not cls:
            raise ValueError(
                f"two remote Functions are named {name!r}: {other.function.__module__}."
                f"{other.function.__qualname__} and {cls.__module__}.{cls.__qualname__}; "
                f"give one of them another remote_name"
            )
        registry[name] = RegisteredFunction(name, cls, fingerprint(cls))
    for module_name in names:
        if not any(r.function.__module__ == module_name for r in registry.values()):
            raise ValueError(
                f"module {module_name!r} defines no Function with dispatch = 'remote': "
                f"nothing to serve from it"
            )
    return registry
