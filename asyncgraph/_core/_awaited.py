"""Coroutines that say so, in asyncgraph's words, when they are never awaited.

``loss.backward()`` without ``await`` is the first habit of every PyTorch and TextGrad
user. A plain coroutine then does nothing and leaves Python's generic "coroutine ... was
never awaited" warning, long after the line that forgot. The entry points of a pass
(``backward``, ``grad``, ``Variable.backward``, ``GradManager.backward``) return a
:class:`MustAwait` instead: a real coroutine (``asyncio.run``, ``anyio.run``, task
groups and ``await`` take it as they take any other) that, when dropped without having
run, warns at the caller's line with what happened and what to write instead.

Nothing runs eagerly when no event loop is running: a pass is always a coroutine, so a
script and an async app behave the same, and ``asyncio.run(loss.backward())`` keeps
working.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Coroutine, Generator
from typing import Any, ParamSpec, TypeVar

__all__ = ["MustAwait", "must_await"]

P = ParamSpec("P")
T = TypeVar("T")


class MustAwait(Coroutine[Any, Any, T]):
    """A coroutine that warns, at the line that made it, if it is dropped unstarted."""

    __slots__ = ("_coro", "_filename", "_lineno", "_name", "_started")

    def __init__(self, coro: Coroutine[Any, Any, T], name: str, depth: int = 2) -> None:
        self._coro = coro
        self._name = name
        self._started = False
        frame = sys._getframe(depth)
        self._filename = frame.f_code.co_filename
        self._lineno = frame.f_lineno

    def send(self, value: Any) -> Any:
        self._started = True
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        self._started = True
        return self._coro.throw(*args)

    def close(self) -> None:
        self._started = True
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        self._started = True
        return self._coro.__await__()

    def __del__(self) -> None:
        if self._started:
            return
        self._coro.close()  # closed unstarted: no generic warning from Python
        warnings.warn_explicit(
            f"{self._name}() was called without await, so no gradient was computed and "
            f"every .grad is unchanged. In asyncgraph a pass is a coroutine: write "
            f"`await {self._name}(...)` inside an async function (from a script: "
            f"`asyncio.run(main())` or `anyio.run(main)`).",
            RuntimeWarning,
            self._filename,
            self._lineno,
        )


def must_await(
    name: str,
) -> Callable[[Callable[P, Coroutine[Any, Any, T]]], Callable[P, MustAwait[T]]]:
    """Decorate an ``async def`` so that its calls return a :class:`MustAwait` named ``name``."""

    def decorate(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, MustAwait[T]]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> MustAwait[T]:
            return MustAwait(fn(*args, **kwargs), name)

        return call

    return decorate
