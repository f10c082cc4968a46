"""Parameter values as JSON data, and back: what ``Module.state_dict`` and a job's
checkpoint store, and the check that a saved value fits the parameter it goes to.

A leaf (it imports nothing of asyncgraph; numpy only when an array is loaded), shared by
the core's ``Module`` and the jobs' checkpoints so that both accept the same values.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["from_json", "is_numpy", "to_json"]


def is_numpy(value: Any) -> bool:
    """A numpy array or scalar (told apart without importing numpy)."""
    return type(value).__module__ == "numpy" and hasattr(value, "tolist")


def to_json(value: Any) -> Any:
    """A parameter's data as JSON data: numpy arrays as nested lists, tuples as lists."""
    if is_numpy(value):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def _kind(value: Any) -> str:
    """The JSON kind of a value, to check a saved value against."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str):
        return "str"
    if is_numpy(value):
        return "array"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "map"
    return "other"


def from_json(current: Any, saved: Any) -> Any:
    """The value for a parameter holding ``current`` from its saved data.

    Raises ``ValueError`` saying what does not fit: a text parameter gets text, a
    number a number, an array an array of the same shape (converted to its dtype).
    A parameter holding None (or an unusual type) takes any value.
    """
    want, have = _kind(current), _kind(saved)
    if want in ("null", "other"):
        return copy.deepcopy(saved)
    if want == "array":
        import numpy

        if have not in ("list", "number", "array"):
            raise ValueError(f"a {have}, not the numbers of an array")
        try:
            value = numpy.asarray(saved, dtype=current.dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an array of {current.dtype} ({exc})") from None
        if value.shape != current.shape:
            raise ValueError(f"an array of shape {value.shape}, not {current.shape}")
        return value
    if have != want:
        raise ValueError(f"a {have}, but the parameter holds a {want}")
    return copy.deepcopy(saved)
