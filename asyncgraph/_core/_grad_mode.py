"""Grad mode: whether applying a Function records it for backward.

The mode lives in a :class:`contextvars.ContextVar`, so it is per task, not per
thread: ``with no_grad():`` inside one coroutine never changes what another
coroutine on the same event loop sees. Every manager works as a context
manager and as a decorator (``no_grad`` and ``enable_grad`` also bare: ``@no_grad``) of
sync functions, coroutine functions, generators and async generators.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, TypeVar, cast

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

_GRAD_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "asyncgraph_grad_enabled", default=True
)

F = TypeVar("F", bound=Callable[..., Any])


def is_grad_enabled() -> bool:
    """Return True when Functions applied in the current task are recorded.

    Example::

        print(is_grad_enabled())        # True
        with no_grad():
            print(is_grad_enabled())    # False
    """
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
        """Decorate ``func`` so that its body runs in this mode (see ``_decorate``)."""
        return _decorate(func, self._mode)


def _decorate(func: F, mode: bool) -> F:
    """``func`` with its body run in grad mode ``mode``.

    Sync and coroutine functions run in ``mode`` for the call. Sync and async
    generators run in ``mode`` at every step (each ``next``/``send``/``throw``/``close``
    and their async forms), and the caller's mode is restored each time control returns
    to the caller, as PyTorch's ``_DecoratorContextManager`` does for generators: a
    streaming wrapper decorated with ``@no_grad()`` records nothing, and the loop that
    consumes it keeps its own mode.
    """
    if inspect.isasyncgenfunction(func):
        return cast(F, _wrap_async_generator(func, mode))
    if inspect.isgeneratorfunction(func):
        return cast(F, _wrap_generator(func, mode))
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


def _in_mode(mode: bool, step: Callable[..., Any], *args: Any) -> Any:
    token = _GRAD_ENABLED.set(mode)
    try:
        return step(*args)
    finally:
        _GRAD_ENABLED.reset(token)


def _wrap_generator(func: Callable[..., Generator[Any, Any, Any]], mode: bool) -> Any:
    @functools.wraps(func)
    def generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        gen = func(*args, **kwargs)  # runs nothing of the body yet
        try:
            response = _in_mode(mode, gen.send, None)
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    _in_mode(mode, gen.close)
                    raise
                except BaseException as exc:
                    response = _in_mode(mode, gen.throw, exc)
                else:
                    response = _in_mode(mode, gen.send, request)
        except StopIteration as stop:
            return stop.value

    return generator


def _wrap_async_generator(func: Callable[..., AsyncGenerator[Any, Any]], mode: bool) -> Any:
    async def step(awaitable: Awaitable[Any]) -> Any:
        token = _GRAD_ENABLED.set(mode)
        try:
            return await awaitable
        finally:
            _GRAD_ENABLED.reset(token)

    @functools.wraps(func)
    async def generator(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        agen = func(*args, **kwargs)  # runs nothing of the body yet
        try:
            response = await step(agen.asend(None))
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    await step(agen.aclose())
                    raise
                except BaseException as exc:
                    response = await step(agen.athrow(exc))
                else:
                    response = await step(agen.asend(request))
        except StopAsyncIteration:
            return

    return generator


class _BareDecorator(_GradModeBase):
    """A mode that also decorates without parentheses: ``@no_grad`` as ``@no_grad()``."""

    def __new__(cls, orig_func: Callable[..., Any] | None = None) -> Any:
        if orig_func is None:
            return super().__new__(cls)
        if not callable(orig_func):
            raise TypeError(
                f"{cls.__name__}() takes no mode; used as @{cls.__name__} or "
                f"@{cls.__name__}() it decorates a function, got {orig_func!r:.60}"
            )
        return _decorate(orig_func, cls._mode)

    def __init__(self, orig_func: Callable[..., Any] | None = None) -> None:
        pass


class no_grad(_BareDecorator):
    """Disable recording: Functions applied inside produce outputs without history.

    Example::

        with no_grad():
            y = Double.apply(x)   # y.grad_fn is None

        @no_grad                  # or @no_grad(); sync, async, generators too
        async def stream(prompt): ...

    Creating leaves (``Parameter(...)``, ``Variable(..., requires_grad=True)``)
    is not affected.
    """

    _mode = False


class enable_grad(_BareDecorator):
    """Enable recording inside a ``no_grad`` region.

    Example::

        with no_grad():
            with enable_grad():
                y = Double.apply(x)     # recorded: y.grad_fn is a Node
    """

    _mode = True


class set_grad_enabled(_GradModeBase):
    """Set grad mode to ``mode``; takes effect immediately, like PyTorch.

    ``set_grad_enabled(False)`` on its own switches the mode for the rest of the
    current task (context); used with ``with`` it restores, on exit, the mode
    from before the call (and sets ``mode`` again on every entry).

    Example::

        with set_grad_enabled(False):
            y = Double.apply(x)         # not recorded
        set_grad_enabled(False)         # alone: for the rest of this task
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
