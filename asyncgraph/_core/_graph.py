"""Nodes of the backward graph.

A :class:`Node` is one application of a Function: it holds the ctx that
forward filled, one edge per forward input and the hooks of its outputs. An
edge is ``(target, output_nr)`` where ``target`` is the Node that produced the
input or, for a leaf that requires grad, the leaf Variable itself; an input that
needs no gradient has the edge ``None``.
"""

from __future__ import annotations

import contextvars
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    from ._function import Function, FunctionCtx
    from ._variable import Variable

__all__ = [
    "AccumulateGrad",
    "Edge",
    "Hook",
    "Node",
    "PostAccumulateHook",
    "RemovableHandle",
    "Seq",
    "graph_order",
    "make_zero",
    "next_seq",
    "zero_template",
]

Target = Union["Node", "Variable"]
Edge = tuple[Target, int]
Hook = Callable[[Any], Any]
PostAccumulateHook = Callable[[Any, Any], Any]
"""A leaf's post-accumulate-grad hook: ``fn(leaf, grad)``, sync or async, returns None."""

# Creation order of nodes: gradients flowing into one variable are summed in
# the order their edges were created, i.e. by (consumer seq, input position).
# A node's seq is taken when apply() is called, so concurrent async forwards
# that finish in any order still sum in the order the program applied them;
# ``graph_order(key)`` prefixes it, for graphs built by concurrent tasks.
_SEQ = itertools.count()
_ORDER: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar(
    "asyncgraph_graph_order", default=()
)

Seq = tuple[int, ...]


def next_seq() -> Seq:
    return (*_ORDER.get(), next(_SEQ))


@contextmanager
def graph_order(*key: int) -> Iterator[None]:
    """Order the nodes created inside the block by ``key`` first, then by creation.

    Gradients that meet in one variable are summed (text feedback listed) in the
    order their nodes were created. When several tasks build parts of a graph
    concurrently, that order depends on the scheduler; give each task a key and
    the order depends only on the keys::

        async def example(i, item):
            with graph_order(i):
                return await forward(item)

    Keys nest (``graph_order(epoch)`` around ``graph_order(i)``) and apply to
    this task only (a contextvar), including tasks it starts.
    """
    for part in key:
        if not isinstance(part, int) or isinstance(part, bool):
            raise TypeError(f"graph_order keys are ints, got {part!r}")
    token = _ORDER.set((*_ORDER.get(), *key))
    try:
        yield
    finally:
        _ORDER.reset(token)


class RemovableHandle:
    """Returned by ``register_hook``; ``handle.remove()`` unregisters the hook."""

    __slots__ = ("_hooks", "_key")

    def __init__(self, hooks: dict[int, Hook], key: int) -> None:
        self._hooks = weakref.ref(hooks)
        self._key = key

    def remove(self) -> None:
        hooks = self._hooks()
        if hooks is not None:
            hooks.pop(self._key, None)


class _HookDict(dict[int, Hook]):
    """A dict that can be weakly referenced (plain dicts cannot)."""

    __slots__ = ("__weakref__",)


_HOOK_KEYS = itertools.count()


def add_hook(hooks: dict[int, Hook], fn: Hook) -> RemovableHandle:
    if not callable(fn):
        raise TypeError(f"register_hook expects a callable taking the gradient, got {fn!r}")
    key = next(_HOOK_KEYS)
    hooks[key] = fn
    return RemovableHandle(hooks, key)


def new_hook_dict() -> dict[int, Hook]:
    return _HookDict()


class Node:
    """One recorded Function application (the ``grad_fn`` of its outputs).

    ``next_functions`` walks the graph as PyTorch's does: one ``(node, output_nr)`` pair
    per forward input, where ``node`` is the Node that computed the input, an
    ``AccumulateGrad`` (``.variable``: the leaf) for a leaf that requires grad, or None
    for an input that needs no gradient. ``next_edges`` is the engine's form of the same
    edges: the leaf Variable itself in place of its ``AccumulateGrad``, None for an
    input that needs none.

    Example::

        y = Double.apply(Parameter(3.0, role="x"))
        node = y.grad_fn            # a Node
        print(node.name, node.describe())    # Double Double(inputs: 'x' -> outputs: '')
        (leaf, nr), = node.next_functions
        print(leaf.name, leaf.variable.role, nr)    # AccumulateGrad x 0
    """

    __slots__ = (
        "__weakref__",
        "ctx",
        "function",
        "input_roles",
        "input_variables",
        "next_edges",
        "num_outputs",
        "output_hooks",
        "output_roles",
        "requires_input_grad",
        "retained",
        "seq",
        "zeros",
    )

    def __init__(
        self,
        function: type[Function],
        ctx: FunctionCtx,
        next_edges: tuple[Edge | None, ...],
        requires_input_grad: tuple[bool, ...],
        input_roles: tuple[str, ...],
        num_outputs: int,
        seq: Seq,
        input_variables: tuple[bool, ...] | None = None,
    ) -> None:
        self.function = function
        self.ctx = ctx
        self.next_edges = next_edges
        self.requires_input_grad = requires_input_grad
        self.input_roles = input_roles
        # Which inputs were Variables: a gradient for one that needs none is dropped,
        # a gradient for a plain value (str, number, option) is an error.
        self.input_variables = (
            input_variables if input_variables is not None else (True,) * len(next_edges)
        )
        self.output_roles: tuple[str, ...] = ()
        self.num_outputs = num_outputs
        self.seq = seq
        # Filled lazily: most nodes never get hooks or retained outputs.
        self.output_hooks: dict[int, dict[int, Hook]] | None = None
        self.retained: dict[int, weakref.ref[Variable]] | None = None
        # Per output, how to make its zero gradient (``ctx.set_materialize_grads``): None
        # when no output is a number or a numpy array.
        self.zeros: tuple[Any, ...] | None = None

    @property
    def name(self) -> str:
        return self.function.__name__

    @property
    def next_functions(self) -> tuple[tuple[Node | AccumulateGrad | None, int], ...]:
        """One ``(node, output_nr)`` per forward input, as PyTorch's ``grad_fn.next_functions``:
        the Node that computed the input, ``AccumulateGrad`` for a leaf, ``(None, 0)`` for
        an input that needs no gradient."""
        pairs: list[tuple[Node | AccumulateGrad | None, int]] = []
        for edge in self.next_edges:
            if edge is None:
                pairs.append((None, 0))
            else:
                target, nr = edge
                pairs.append(
                    (target, nr) if isinstance(target, Node) else (AccumulateGrad(target), 0)
                )
        return tuple(pairs)

    def describe(self) -> str:
        """``Name(inputs: 'a', 'b' -> outputs: 'y')`` for error messages."""
        ins = ", ".join(repr(r) for r in self.input_roles) or "-"
        outs = ", ".join(repr(r) for r in self.output_roles) or "-"
        return f"{self.name}(inputs: {ins} -> outputs: {outs})"

    def hooks_for(self, output_nr: int) -> dict[int, Hook]:
        if self.output_hooks is None:
            self.output_hooks = {}
        hooks = self.output_hooks.get(output_nr)
        if hooks is None:
            hooks = self.output_hooks[output_nr] = new_hook_dict()
        return hooks

    @property
    def freed(self) -> bool:
        """Whether an earlier backward freed what forward saved: a later backward through
        this node raises. A node that saved nothing is never freed, as in PyTorch."""
        return self.ctx._saved is None

    def release(self) -> None:
        """Free what forward saved (``ctx.save_for_backward``)."""
        self.ctx._free()

    def __repr__(self) -> str:
        return f"<Node {self.describe()} seq={self.seq}>"


class AccumulateGrad:
    """The leaf end of an edge in ``Node.next_functions``: PyTorch's AccumulateGrad node.

    ``variable`` is the leaf whose ``.grad`` the edge fills; ``name`` is
    ``"AccumulateGrad"``; ``next_functions`` is empty, where a walk of the graph stops.
    Two of them are equal when they stand for the same leaf.
    """

    __slots__ = ("variable",)

    name = "AccumulateGrad"
    next_functions: tuple[tuple[Node | AccumulateGrad | None, int], ...] = ()

    def __init__(self, variable: Variable) -> None:
        self.variable = variable

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AccumulateGrad) and other.variable is self.variable

    def __hash__(self) -> int:
        return id(self.variable)

    def __repr__(self) -> str:
        return f"<AccumulateGrad of {self.variable!r}>"


def zero_template(data: Any) -> Any:
    """How to make a zero like ``data`` later, without keeping ``data``: its type for a
    number, (shape, dtype) for a numpy array; None for anything else (text)."""
    kind = type(data)
    if kind is int or kind is float:
        return kind
    if kind.__module__ == "numpy" and hasattr(data, "shape") and hasattr(data, "dtype"):
        return (data.shape, data.dtype)
    return None


def make_zero(template: Any) -> Any:
    """A zero made from ``zero_template``'s template."""
    if isinstance(template, tuple):
        import numpy

        return numpy.zeros(template[0], dtype=template[1])
    return template()
