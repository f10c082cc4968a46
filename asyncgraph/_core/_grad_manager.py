"""GradManager: MegEngine's way to say which variables get gradients, and when.

Example::

    gm = GradManager().attach(model_params, callbacks=[clip])
    with gm:                      # record()
        loss = await model(x)
        await gm.backward(loss)   # grads into attached .grad, then release()
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Self

from asyncgraph._core._executor import Executor, current_executor
from asyncgraph._exceptions import GraphError

from ._autodiff import _as_variables, _roots, _target
from ._awaited import must_await
from ._engine import Engine, Listener
from ._graph import Edge, Node, next_seq
from ._variable import Variable

__all__ = ["GradManager", "GradManagerGroup"]

Callback = Callable[[Variable, Variable], Any]


class _Attached:
    __slots__ = ("callbacks", "ref")

    def __init__(self, var: Variable, callbacks: list[Callback]) -> None:
        self.ref = weakref.ref(var)
        self.callbacks = callbacks


def _chained(var: Variable, callbacks: list[Callback]) -> Callable[[Variable], Any]:
    """A gradient hook running ``callbacks`` in order, each on the previous one's result."""

    async def hook(grad: Variable) -> Variable:
        for cb in callbacks:
            result = cb(var, grad)
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                grad = result if isinstance(result, Variable) else Variable(result)
        return grad

    names = ", ".join(getattr(cb, "__qualname__", repr(cb)) for cb in callbacks)
    hook.__qualname__ = f"GradManager callbacks [{names}]"  # what a failure names
    return hook


class _RecordingBlock:
    """``with`` / ``async with``: ``record()`` on entry, ``release()`` on exit."""

    def record(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.record()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)


class GradManager(_RecordingBlock):
    """Attach variables, record a forward, and backward into the attached ones only.

    - ``attach(variables, callbacks=None)``: track these (weakly: a variable
      that dies is forgotten); each callback ``(variable, grad) -> grad`` may be
      sync or async. They run during the pass, the moment that variable's gradient
      is final, in attach order, each on the previous one's result (returning None
      keeps the gradient); ``.grad`` is updated only if the whole pass succeeds.
      Attaching again adds callbacks.
    - ``record()`` / ``release()``, or ``with gm:`` / ``async with gm:``. Only
      computation between them counts: a forward run before ``record()`` gives no
      gradient through ``gm.backward`` (as MegEngine documents).
    - ``await backward(y=None, dy=None)``: requires recording (else
      ``RuntimeError``); accumulates into the ``.grad`` of attached variables
      only (and of variables that called ``retain_grad()``, as every pass does),
      then releases. ``y=None`` only releases.
    - ``gm1 | gm2`` makes a :class:`GradManagerGroup` that records together.

    Example::

        gm = GradManager().attach([w])
        with gm:                    # record the forward ...
            y = Double.apply(w)
            await gm.backward(y)    # ... then backward into w.grad only, and release
    """

    def __init__(
        self, *, executor: Executor | None = None, listeners: Iterable[Listener] = ()
    ) -> None:
        self._attached: dict[int, _Attached] = {}
        self._recording = False
        self._since: int | None = None
        self._group: GradManagerGroup | None = None
        self.executor = executor
        self.listeners = tuple(listeners)

    def attach(
        self,
        variables: Variable | Sequence[Variable],
        callbacks: Callback | Sequence[Callback] | None = None,
    ) -> GradManager:
        """Track ``variables`` (setting ``requires_grad`` on leaves); returns self."""
        vars_ = _as_variables(variables, "variables")
        if callbacks is None:
            cbs: list[Callback] = []
        elif callable(callbacks):
            cbs = [callbacks]
        else:
            cbs = list(callbacks)
        for cb in cbs:
            if not callable(cb):
                raise TypeError(
                    f"GradManager callbacks must be callables (variable, grad) -> grad, got {cb!r}"
                )
        for var in vars_:
            if var.is_leaf and not var.requires_grad:
                var.requires_grad = True
            if not var.requires_grad:
                raise GraphError(f"cannot attach {var!r}: it does not require grad")
            key = id(var)
            entry = self._attached.get(key)
            if entry is not None and entry.ref() is var:
                entry.callbacks.extend(cbs)
            else:
                self._attached[key] = _Attached(var, list(cbs))
                weakref.finalize(var, self._attached.pop, key, None)
        return self

    def attached_variables(self) -> list[Variable]:
        """The attached variables that are still alive, in attach order."""
        alive = []
        for entry in self._attached.values():
            var = entry.ref()
            if var is not None:
                alive.append(var)
        return alive

    @property
    def is_recording(self) -> bool:
        return self._recording

    def record(self) -> None:
        """Start recording: a later ``backward`` may differentiate what runs now.

        Raises ``GraphError`` (a ``RuntimeError``, as in MegEngine) if already recording.
        """
        if self._recording:
            raise GraphError("this GradManager is already recording; call release() first")
        self._recording = True
        # Computation before this point is ignored by backward (MegEngine: "any
        # computation on a tensor before it is attached is completely ignored").
        self._since = next_seq()[-1]

    def release(self) -> None:
        """Stop recording; ``backward`` then raises until the next ``record()``.

        The graph itself lives as long as the outputs that reference it.
        """
        self._recording = False

    @must_await("gm.backward")
    async def backward(
        self, y: Variable | Sequence[Variable] | None = None, dy: Any = None
    ) -> None:
        """Accumulate d(y)/d(attached) into the attached variables' ``.grad``, then release."""
        if not self._recording:
            raise GraphError(
                "no computation history: call gm.record() (or use `with gm:`) before the "
                "forward pass, and call gm.backward() only once per recording"
            )
        try:
            if y is None:
                return
            outputs = _as_variables(y, "y")
            live = self._live_attached()
            if live:
                roots = _roots(outputs, dy, "y", "dy", sequence=isinstance(y, (list, tuple)))
                await self._differentiate(roots, live)
        finally:
            self.release()

    def _live_attached(self) -> list[tuple[Variable, list[Callback]]]:
        """The attached variables still alive, with their callbacks, in attach order."""
        attached = [(e.ref(), e.callbacks) for e in self._attached.values()]
        return [(v, cbs) for v, cbs in attached if v is not None]

    async def _differentiate(
        self, roots: list[tuple[Edge, Variable | None]], live: list[tuple[Variable, list[Callback]]]
    ) -> None:
        """One pass from ``roots`` into the ``live`` attached variables, their callbacks run
        inside it; their ``.grad`` is written only when the whole pass succeeds."""
        leaves = [v for v, _ in live if v.grad_fn is None]
        node_outputs: list[tuple[Node, int]] = [
            (v.grad_fn, v.output_nr) for v, _ in live if v.grad_fn is not None
        ]
        engine = Engine(
            self.executor or current_executor(),
            create_graph=False,
            keep_graph=self._graph_needed_by_group(),
            listeners=self.listeners,
            since=self._since,
        )
        # Callbacks run inside the pass, the moment each attached variable's gradient
        # is final (as a gradient hook of this pass: what lets an allreduce overlap
        # the rest of the backward); the results are committed only if it succeeds.
        handles = [var.register_hook(_chained(var, cbs)) for var, cbs in live if cbs]
        try:
            await engine.run(
                roots, capture_leaves=leaves, capture_outputs=node_outputs, accumulate=False
            )
        finally:
            for handle in handles:
                handle.remove()
        # Committed only once the whole pass succeeded, through the engine's one
        # commit path (each .grad its own object; a caller's dy is never written).
        for var, _ in live:
            g = engine.captured.get(_target(var))
            if g is not None:
                engine.stage(var, g)
        engine.commit()

    def _graph_needed_by_group(self) -> bool:
        """Whether another manager recording with this one (``gm1 | gm2``) may still call
        backward on the same graph: then this pass keeps it."""
        group = self._group.managers if self._group is not None else ()
        return any(gm is not self and gm.is_recording for gm in group)

    def __or__(self, other: GradManager | GradManagerGroup) -> GradManagerGroup:
        return GradManagerGroup([self]) | other


class GradManagerGroup(_RecordingBlock):
    """Several GradManagers that record and release together: ``with gm1 | gm2:``.

    Example::

        with gm1 | gm2:             # a GradManagerGroup: both record this forward
            y = Double.apply(w1)
            z = Double.apply(w2)
            await gm1.backward(y)
            await gm2.backward(z)
    """

    def __init__(self, managers: Iterable[GradManager] = ()) -> None:
        self._managers: list[GradManager] = []
        for gm in managers:
            self._add(gm)

    def _add(self, gm: GradManager) -> None:
        if not isinstance(gm, GradManager):
            raise TypeError(f"a GradManagerGroup holds GradManagers, got {gm!r}")
        if all(gm is not m for m in self._managers):
            self._managers.append(gm)

    @property
    def managers(self) -> tuple[GradManager, ...]:
        return tuple(self._managers)

    def __or__(self, other: GradManager | GradManagerGroup) -> GradManagerGroup:
        group = GradManagerGroup(self._managers)
        for gm in other._managers if isinstance(other, GradManagerGroup) else [other]:
            group._add(gm)
        return group

    __ror__ = __or__

    def record(self) -> None:
        for gm in self._managers:
            gm.record()
            gm._group = self

    def release(self) -> None:
        for gm in self._managers:
            gm.release()
            if gm._group is self:
                gm._group = None
