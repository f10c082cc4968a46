"""Variable and Parameter: the values that flow through a graph."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from asyncgraph._exceptions import GraphError

from ._awaited import must_await
from ._graph import Hook, Node, PostAccumulateHook, RemovableHandle, add_hook, new_hook_dict

if TYPE_CHECKING:
    from asyncgraph._core._executor import Executor

    from ._engine import Listener

__all__ = ["Parameter", "Variable"]

_SCALARS = (str, int, float, bool, type(None))


def _check_data(data: Any, depth: int = 0) -> None:
    kind = type(data)
    if kind in _SCALARS or isinstance(data, _SCALARS):
        return
    if depth > 64:
        raise TypeError("Variable data is nested more than 64 levels deep")
    if isinstance(data, (list, tuple)):
        for item in data:
            _check_data(item, depth + 1)
        return
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                raise TypeError(f"Variable data dict keys must be str, got {key!r}")
            _check_data(value, depth + 1)
        return
    if kind.__module__ == "numpy":  # ndarray and numpy scalars, without importing numpy
        return
    raise TypeError(
        f"Variable data must be str, int, float, bool, None, a list or dict of these, "
        f"or a numpy array; got {kind.__name__} ({data!r:.80}). "
        f"Wrap it in one of those types or keep it as a non-Variable argument."
    )


class Variable:
    """A value in the graph: text, numbers, or structures of them.

    ``requires_grad=True`` on a leaf asks ``backward`` to accumulate a gradient
    into ``.grad`` (itself a Variable). Outputs of recorded Functions carry the
    node that made them in ``.grad_fn``.

    Example::

        x = Variable("a draft answer", role="answer", requires_grad=True)
        await loss.backward()
        print(x.grad.data)
    """

    __slots__ = (
        "__weakref__",
        "_grad",
        "_grad_fn",
        "_hooks",
        "_output_nr",
        "_post_hooks",
        "_requires_grad",
        "_version",
        "data",
        "role",
    )

    def __init__(self, data: Any = None, role: str = "", requires_grad: bool = False) -> None:
        if type(data) not in _SCALARS:
            if isinstance(data, Variable):
                raise TypeError(
                    "Variable(data) got a Variable; use .detach() to copy one or pass .data"
                )
            _check_data(data)
        if not isinstance(role, str):
            raise TypeError(f"role must be a str, got {role!r}")
        self.data = data
        self.role = role
        self._requires_grad = bool(requires_grad)
        self._grad: Variable | None = None
        self._grad_fn: Node | None = None
        self._output_nr = 0
        self._hooks: dict[int, Hook] | None = None
        self._post_hooks: dict[int, PostAccumulateHook] | None = None
        # In-place changes a Function declared (ctx.mark_dirty), as PyTorch's _version.
        self._version = 0

    # -- graph properties -------------------------------------------------
    @property
    def grad_fn(self) -> Node | None:
        """The node that computed this Variable (None for a leaf)."""
        return self._grad_fn

    @grad_fn.setter
    def grad_fn(self, value: Any) -> None:
        raise AttributeError(
            "attribute 'grad_fn' of 'Variable' objects is not writable: it is set when a "
            "Function computes the Variable; use detach() or detach_() to cut it from the graph"
        )

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        # PyTorch 2.x: assigning the flag of a non-leaf raises, for True as for False.
        if self.grad_fn is not None:
            self._refuse_non_leaf(bool(value))
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad: bool = True) -> Variable:
        """Set ``requires_grad`` in place and return this variable (PyTorch's rules: on a
        non-leaf, True is a no-op and False raises ``GraphError``, a ``RuntimeError``)."""
        if self.grad_fn is not None:
            if requires_grad:
                return self  # a computed variable requires grad already
            self._refuse_non_leaf(False)
        self._requires_grad = bool(requires_grad)
        return self

    def _refuse_non_leaf(self, value: bool) -> None:
        assert self.grad_fn is not None
        hint = (
            " If you want to use a computed variable in a subgraph that doesn't require "
            "differentiation use var_no_grad = var.detach()."
            if not value
            else ""
        )
        raise GraphError(
            f"you can only change requires_grad flags of leaf variables; {self!r} was "
            f"computed by {self.grad_fn.name}.{hint}"
        )

    @property
    def grad(self) -> Variable | None:
        """The gradient accumulated by backward (a Variable), or None."""
        return self._grad

    @grad.setter
    def grad(self, value: Variable | None) -> None:
        if value is not None and not isinstance(value, Variable):
            raise TypeError(
                f"assigned grad must be a Variable or None, got {type(value).__name__} "
                f"({value!r:.60}); wrap the data: x.grad = Variable(...)"
            )
        self._grad = value

    @grad.deleter
    def grad(self) -> None:
        self._grad = None

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def output_nr(self) -> int:
        return self._output_nr

    def retain_grad(self) -> None:
        """Keep this non-leaf's gradient in ``.grad`` after backward (leaves always do)."""
        node = self.grad_fn
        if node is None:
            if not self._requires_grad:
                raise GraphError(
                    f"can't retain_grad on Variable that has requires_grad=False: {self!r} "
                    f"does not require grad"
                )
            return
        if node.retained is None:
            node.retained = {}
        node.retained[self._output_nr] = weakref.ref(self)

    @property
    def retains_grad(self) -> bool:
        node = self.grad_fn
        if node is None or node.retained is None:
            return False
        ref = node.retained.get(self._output_nr)
        return ref is not None and ref() is self

    def register_hook(self, fn: Hook) -> RemovableHandle:
        """Call ``fn(grad)`` when this variable's gradient is computed.

        ``fn`` may be sync or ``async def``; returning a value (Variable or raw
        data) replaces the gradient, returning None keeps it. Hooks run in the
        order they were registered. ``handle.remove()`` unregisters.

        On a computed variable (one output of a node), ``fn`` runs whenever the node's
        backward runs: with None when no gradient reached this output but one reached
        a sibling output, as in PyTorch (a node that got no gradient at all does not
        run). On a leaf, ``fn`` runs only when a gradient reaches it.
        """
        if not self._requires_grad:
            raise GraphError(
                f"cannot register a hook on a Variable that doesn't require gradient: "
                f"{self!r} does not require grad"
            )
        if self.grad_fn is not None:
            return add_hook(self.grad_fn.hooks_for(self._output_nr), fn)
        if self._hooks is None:
            self._hooks = new_hook_dict()
        return add_hook(self._hooks, fn)

    def register_post_accumulate_grad_hook(self, fn: PostAccumulateHook) -> RemovableHandle:
        """Call ``fn(variable, grad)`` once per ``backward`` when this leaf's gradient is final.

        PyTorch's ``register_post_accumulate_grad_hook``, adapted to a backward whose
        leaves are committed all or nothing: ``fn`` runs *inside* the pass, as soon as
        every contribution to this leaf has arrived (and its ``register_hook`` hooks
        ran), while the rest of the backward may still be running. It receives the
        leaf and *this pass's* gradient (a Variable); ``.grad`` is not written yet: it
        is committed (added to any existing ``.grad``) only if the whole pass succeeds.
        So whatever ``fn`` derives from the gradient should be staged and used only
        once ``backward`` has returned (``TGD(..., staged=True)`` does this).

        ``fn`` may be sync or ``async def`` (the pass waits for it, as for any node);
        it must return None. It does not run for a leaf that receives no gradient, nor
        in ``asyncgraph.grad()`` / ``GradManager`` passes (they do not accumulate into
        ``.grad``). If the pass fails, running hooks are cancelled; a hook that raises
        fails the pass (``BackwardError``, no ``.grad`` changes). Leaves only
        (``RuntimeError`` otherwise). ``handle.remove()`` unregisters.
        """
        if self.grad_fn is not None:
            raise GraphError(
                f"post-accumulate-grad hooks can only be registered on leaves; {self!r} is "
                f"computed by {self.grad_fn.name}"
            )
        if not self._requires_grad:
            raise GraphError(
                f"cannot register a post-accumulate-grad hook on {self!r}: it does not require grad"
            )
        if self._post_hooks is None:
            self._post_hooks = new_hook_dict()  # type: ignore[assignment]
        return add_hook(self._post_hooks, fn)  # type: ignore[arg-type]

    def detach(self) -> Variable:
        """A new leaf with the same data and role, cut from the graph."""
        return Variable(self.data, role=self.role)

    def detach_(self) -> Variable:
        """Cut this Variable from the graph in place (PyTorch's ``detach_``): it becomes a
        leaf that does not require grad. Returns it."""
        self._grad_fn = None
        self._output_nr = 0
        self._requires_grad = False
        return self

    @must_await("loss.backward")
    async def backward(
        self,
        grad: Any = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Variable | Sequence[Variable] | None = None,
        *,
        gradient: Any = None,
        executor: Executor | None = None,
        listeners: Iterable[Listener] = (),
    ) -> None:
        """``await y.backward()``: accumulate d(y)/d(leaf) into every leaf's ``.grad``.

        Same as ``await asyncgraph.backward(self, grad, ...)``; see there. ``gradient=``
        is PyTorch's name for ``grad`` (``Tensor.backward(gradient=...)``).

        A pass is a coroutine, in scripts as in async apps: ``loss.backward()`` without
        ``await`` runs nothing, and asyncgraph warns (``RuntimeWarning``) at that line with
        the form to write instead.
        """
        from ._autodiff import backward

        if gradient is not None:
            if grad is not None:
                raise TypeError("backward() got both grad and gradient: pass one of them")
            grad = gradient
        await backward(
            self,
            None if grad is None else (grad,),
            retain_graph=retain_graph,
            create_graph=create_graph,
            inputs=inputs,
            executor=executor,
            listeners=listeners,
        )

    def __add__(self, other: Any) -> Variable:
        """``a + b``: numbers add, texts concatenate, differentiably (see ``asyncgraph._core._arith``)."""
        from ._arith import Add

        out: Variable = Add.apply(self, other)
        return out

    def __radd__(self, other: Any) -> Variable:
        from ._arith import Add

        out: Variable = Add.apply(other, self)
        return out

    def __repr__(self) -> str:
        parts = [_shorten(repr(self.data), _REPR_VALUE_CHARS)]
        if self.role:
            parts.append(f"role={_shorten(self.role, _REPR_ROLE_CHARS)!r}")
        if self.grad_fn is not None:
            parts.append(f"grad_fn={self.grad_fn.name}")
        elif self._requires_grad:
            parts.append("requires_grad=True")
        return f"{type(self).__name__}({', '.join(parts)})"


_REPR_VALUE_CHARS = 60
_REPR_ROLE_CHARS = 40


def _shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut shown with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Parameter(Variable):
    """A leaf that requires grad: what an optimizer updates.

    Not affected by ``no_grad()``, like creating any leaf.

    Example::

        prompt = Parameter("Answer concisely.", role="system prompt")
        answer = await llm_call(prompt, question, model="simulated")
        await TextLoss("Is the answer right?", model="simulated")(answer)   # then backward
        print(prompt.requires_grad, prompt.is_leaf)     # True True
    """

    __slots__ = ()

    def __init__(self, data: Any = None, role: str = "", requires_grad: bool = True) -> None:
        super().__init__(data, role=role, requires_grad=requires_grad)
