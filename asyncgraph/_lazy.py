"""A package interface whose names load their module when first used (PEP 562).

``asyncgraph.jobs`` and ``asyncgraph.distributed`` export names whose modules pull in the
Redis client, httpx, rich and the optimizers; a command's ``--help`` or ``import
asyncgraph.jobs._demo_cli`` needs none of them. Such a package says where each name
lives and loads it on first access::

    __getattr__, __dir__ = lazy_exports(__name__, {"run_job": "._runner", ...})

with the same names imported under ``if TYPE_CHECKING:`` for type checkers and the API
reference. ``from asyncgraph.jobs import run_job`` works as before: Python asks the
package's ``__getattr__`` for a name it does not hold yet.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose name ``n`` is in the module
    ``where[n]`` (relative to ``package``, e.g. ``"._runner"``)."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later uses find it at once
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
