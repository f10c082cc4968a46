"""The public surface: each package's ``__init__`` is its interface, one home per name.

The counted packages are what a user imports. The leaves and the fleet's insides
(``asyncgraph.resp``, ``asyncgraph.taskhooks``, ``asyncgraph.distributed.wire``,
``asyncgraph.distributed.worker``) serve the other packages; their lists are kept short
too, but they are not part of the user's surface.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC = [
    "asyncgraph",
    "asyncgraph.models",
    "asyncgraph.text",
    "asyncgraph.optim",
    "asyncgraph.jobs",
    "asyncgraph.observe",
    "asyncgraph.observe.otel",
    "asyncgraph.distributed",
]
INNER = [
    "asyncgraph.resp",
    "asyncgraph.taskhooks",
    "asyncgraph.distributed.wire",
    "asyncgraph.distributed.worker",
    "asyncgraph.jobs.demo",
]
BUDGET = 151  # names a user can import, in all: each list readable in one screen
# (151: asyncgraph.models.Secret, the one way to mark a header or config value a secret)


def names(package: str) -> list[str]:
    return list(importlib.import_module(package).__all__)


@pytest.mark.parametrize("package", PUBLIC + INNER)
def test_each_list_is_sorted_importable_and_documented(package: str) -> None:
    module = importlib.import_module(package)
    listed = names(package)
    assert listed == sorted(listed), package
    assert len(listed) <= 45, f"{package} lists {len(listed)} names: more than one screen"
    for name in listed:
        value = getattr(module, name)  # importable
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{package}.{name} has no docstring"


def test_one_home_per_name() -> None:
    homes: dict[str, list[str]] = {}
    for package in PUBLIC:
        for name in names(package):
            homes.setdefault(name, []).append(package)
    doubled = {name: where for name, where in homes.items() if len(where) > 1}
    assert doubled == {}


def test_the_public_surface_stays_within_its_budget() -> None:
    counts = {package: len(names(package)) for package in PUBLIC}
    assert sum(counts.values()) < BUDGET, counts
