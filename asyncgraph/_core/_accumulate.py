"""How gradients of each data type are summed.

Several gradients flowing into one variable are summed left to right in graph
order (the order the edges were created), never in completion order:

- numbers (int, float) and numpy arrays add;
- text feedback accumulates into a list: ``"a" + "b"`` gives ``["a", "b"]``,
  lists concatenate, so feedback from every path is kept, in order;
- other types: ``register_accumulator(MyType, fn)``, where ``fn(a, b)``
  returns the sum of two gradients without modifying either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["accumulate", "register_accumulator"]

Accumulator = Callable[[Any, Any], Any]

_ACCUMULATORS: dict[type, Accumulator] = {}


def register_accumulator(data_type: type, fn: Accumulator) -> None:
    """Use ``fn(a, b)`` to sum two gradients whose data is of ``data_type``.

    Subclasses of ``data_type`` use ``fn`` too, unless they have their own.
    Registering a type again replaces its accumulator.

    Example::

        register_accumulator(frozenset, lambda a, b: a | b)   # two gradients: their union
    """
    if not isinstance(data_type, type):
        raise TypeError(f"register_accumulator expects a type, got {data_type!r}")
    if not callable(fn):
        raise TypeError(f"register_accumulator expects a callable, got {fn!r}")
    _ACCUMULATORS[data_type] = fn


def _add(a: Any, b: Any) -> Any:
    return a + b


def _text(a: Any, b: Any) -> list[Any]:
    left = list(a) if isinstance(a, list) else [a]
    right = list(b) if isinstance(b, list) else [b]
    return left + right


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


def _lookup(data_type: type) -> Accumulator | None:
    for klass in data_type.__mro__:
        fn = _ACCUMULATORS.get(klass)
        if fn is not None:
            return fn
    return None


def accumulate(a: Any, b: Any) -> Any:
    """Return the sum of gradient data ``a`` and ``b`` (``a`` first)."""
    ta, tb = type(a), type(b)
    if ta in (int, float) and tb in (int, float):
        return a + b
    if _is_text(a) and _is_text(b):
        return _text(a, b)
    fn = _lookup(ta) or _lookup(tb)
    if fn is None and (_register_numpy(ta) or _register_numpy(tb)):
        fn = _lookup(ta) or _lookup(tb)
    if fn is not None:
        return fn(a, b)
    raise TypeError(
        f"cannot sum gradients of types {ta.__name__} and {tb.__name__} "
        f"({a!r:.80} + {b!r:.80}); register how with "
        f"asyncgraph.register_accumulator({ta.__name__}, fn)"
    )


def _register_numpy(data_type: type) -> bool:
    """Register numpy's accumulators the first time a numpy value is summed.

    Lazy, so ``import asyncgraph`` never imports numpy. True if ``data_type`` is a
    numpy type and the accumulators were registered now.
    """
    if data_type.__module__.split(".")[0] != "numpy" or _NUMPY_REGISTERED:
        return False
    import numpy

    globals()["_NUMPY_REGISTERED"] = True
    for klass in (numpy.ndarray, numpy.generic):
        _ACCUMULATORS.setdefault(klass, _add)  # a user's own registration wins
    return True


_NUMPY_REGISTERED = False
register_accumulator(int, _add)
register_accumulator(float, _add)
