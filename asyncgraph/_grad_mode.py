"""Grad mode: whether applying a Function records it for backward.

The mode lives in a :class:`contextvars.ContextVar`, so it is per task, not per
thread: ``with no_grad():`` inside one coroutine never changes what another
coroutine on the same event loop sees. Every manager works as a context
manager and as a decorator of sync and async functions.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

_GRAD_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "asyncgraph_grad_enabled", default=True
)

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Return True when Functions applied in the current task are recorded."""
    return _GRAD_ENABLED.get()


# Modes to restore on exit, per task (a context manager object may be shared by
# several tasks, so the saved state cannot live on the object).
_SAVED: contextvars.ContextVar[tuple[bool, ...]] = contextvars.ContextVar(
    "asyncgraph_grad_saved", default=()
)


class _GradModeBase:
    """A context manager and decorator that sets grad mode for its extent."""

    _mode: bool

    def __enter__(self) -> None:
        _SAVED.set((*_SAVED.get(), _GRAD_ENABLED.get()))
        _GRAD_ENABLED.set(self._mode)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        saved = _SAVED.get()
        _GRAD_ENABLED.set(saved[-1])
        _SAVED.set(saved[:-1])

    def __call__(self, func: F) -> F:
        mode = self._mode
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                token = _GRAD_ENABLED.set(mode)
                try:
                    return await func(*args, **kwargs)
                finally:
                    _GRAD_ENABLED.reset(token)

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = _GRAD_ENABLED.set(mode)
            try:
                return func(*args, **kwargs)
            finally:
                _GRAD_ENABLED.reset(token)

        return cast(F, wrapper)


class no_grad(_GradModeBase):
    """Disable recording: Functions applied inside produce outputs without history.

    Example::

        with no_grad():
            y = Double.apply(x)   # y.grad_fn is None

    Creating leaves (``Parameter(...)``, ``Variable(..., requires_grad=True)``)
    is not affected.
    """

    _mode = False


class enable_grad(_GradModeBase):
    """Enable recording inside a ``no_grad`` region."""

    _mode = True


class set_grad_enabled(_GradModeBase):
    """Set grad mode to ``mode``; takes effect immediately, like PyTorch.

    ``set_grad_enabled(False)`` on its own switches the mode for the rest of the
    current task (context); used with ``with`` it restores, on exit, the mode
    from before the call (and sets ``mode`` again on every entry).
    """

    def __init__(self, mode: bool) -> None:
        if not isinstance(mode, bool):
            raise TypeError(f"set_grad_enabled(mode) expects a bool, got {mode!r}")
        self._mode = mode
        self._prev = _GRAD_ENABLED.get()
        self._switched = True  # the switch made here is undone by the first exit
        _GRAD_ENABLED.set(mode)

    def __enter__(self) -> None:
        if self._switched:
            self._switched = False
            _SAVED.set((*_SAVED.get(), self._prev))
            return
        super().__enter__()

    def __call__(self, func: F) -> F:
        # Used as a decorator, the constructor must not have switched the caller's mode.
        if self._switched:
            self._switched = False
            _GRAD_ENABLED.set(self._prev)
        return super().__call__(func)
