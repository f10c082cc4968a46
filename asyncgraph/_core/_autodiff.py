"""``backward()`` and ``grad()``: the public entry points of the engine."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from asyncgraph._core._executor import Executor, current_executor
from asyncgraph._exceptions import GraphError

from ._awaited import must_await
from ._engine import Engine, Listener
from ._graph import Edge, Node, make_zero, zero_template
from ._variable import Variable

__all__ = ["backward", "grad"]

Variables = Variable | Sequence[Variable]


def _as_variables(value: Variables, what: str) -> list[Variable]:
    if isinstance(value, Variable):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{what} must be a Variable or a list/tuple of Variables, got "
            f"{type(value).__name__} ({value!r:.60})"
        )
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, Variable):
            raise TypeError(
                f"{what}[{i}] must be a Variable, got {type(item).__name__} ({item!r:.60})"
            )
    return items


def implicit_grad(var: Variable, index: int, what: str) -> Variable:
    """The gradient of a scalar output with respect to itself.

    A single number gets 1 (of its own type), a single string gets the empty
    feedback ``""`` (no criticism yet: the text functions' backwards read it
    as "no specific feedback"), a one-element numpy array gets ones.
    """
    data = var.data
    if isinstance(data, bool):
        pass
    elif isinstance(data, int):
        return Variable(1)
    elif isinstance(data, float):
        return Variable(1.0)
    elif isinstance(data, str):
        return Variable("")
    elif type(data).__module__ == "numpy" and getattr(data, "size", 0) == 1:
        import numpy

        return Variable(numpy.ones_like(data))
    raise GraphError(
        f"grad can be implicitly created only for scalar outputs (a single number or a "
        f"single string), but {what}[{index}] ({var!r}) holds {type(data).__name__}; pass "
        f"its gradient explicitly (grad_variables / grad_outputs)"
    )


def _grad_list(grads: Any, n: int, sequence: bool) -> list[Any]:
    """One gradient per output.

    ``sequence``: the outputs were given as a list or tuple; then the gradients are one
    per output too (a list or tuple; a single non-sequence value counts as one), as in
    PyTorch: ``grad([y], [x], grad_outputs=[np.ones(3)])``. For a single output given
    bare, a tuple is a sequence of gradients and a list is one too when it holds only
    Variables or None; otherwise it is that output's gradient data (text feedback such as
    ``y.backward(["a", "b"])``).
    """
    if grads is None:
        return [None] * n
    if isinstance(grads, tuple):
        return list(grads)
    if isinstance(grads, list) and (
        sequence or all(g is None or isinstance(g, Variable) for g in grads)
    ):
        return list(grads)
    return [grads]


def _roots(
    outputs: list[Variable], grads: Any, what: str, grads_name: str, sequence: bool = False
) -> list[tuple[Edge, Variable | None]]:
    grad_list = _grad_list(grads, len(outputs), sequence)
    if len(grad_list) != len(outputs):
        raise GraphError(
            f"{grads_name} has {len(grad_list)} entries but {what} has {len(outputs)} (got "
            f"{len(outputs)} variables and {len(grad_list)} gradients); give one gradient "
            f"(or None for an implicit one) per output"
        )
    roots: list[tuple[Edge, Variable | None]] = []
    for i, (out, g) in enumerate(zip(outputs, grad_list, strict=True)):
        if not out.requires_grad:
            raise GraphError(
                f"element {i} of {what} ({out!r}) does not require grad and does not have "
                f"a grad_fn: nothing to differentiate. Did you build it under no_grad(), "
                f"or from leaves without requires_grad=True?"
            )
        if g is None:
            g = implicit_grad(out, i, what)
        elif not isinstance(g, Variable):
            g = Variable(g)
        edge: Edge = (out.grad_fn, out.output_nr) if out.grad_fn is not None else (out, 0)
        roots.append((edge, g))
    return roots


@must_await("backward")
async def backward(
    variables: Variables,
    grad_variables: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Variables | None = None,
    *,
    grad_tensors: Any = None,
    executor: Executor | None = None,
    listeners: Iterable[Listener] = (),
) -> None:
    """Accumulate the gradients of ``variables`` into the ``.grad`` of the leaves.

    ``grad_tensors=`` is PyTorch's name for ``grad_variables`` (give one of them).

    ``grad_variables``: one gradient per variable (Variable, raw data or None);
    None is allowed for scalar outputs only (1 for a number, ``""`` for text).
    ``retain_graph`` (default: ``create_graph``) keeps the graph for another
    backward. ``create_graph`` records the backward's own operations, so the
    gradients can be differentiated again. ``inputs`` restricts accumulation to
    these variables (a non-leaf among them gets its gradient in ``.grad`` too).
    ``executor`` chooses where backwards run (default: ``use_executor``'s, else
    in-process). ``listeners`` get a ``NodeEvent`` when each node starts, finishes
    or fails.

    Raises ``BackwardError`` naming the failing node (others are cancelled and
    no ``.grad`` is changed), ``GraphError`` for a freed graph or bad inputs.

    Example::

        await backward([loss1, loss2])               # both losses, one pass
        await backward(y, grad_variables=Variable(0.5), inputs=[w])
        print(w.grad.data)
    """
    if grad_tensors is not None:
        if grad_variables is not None:
            raise TypeError("backward() got both grad_variables and grad_tensors: pass one")
        grad_variables = grad_tensors
    outputs = _as_variables(variables, "variables")
    if not outputs:
        raise GraphError("backward() got no variables to differentiate")
    roots = _roots(
        outputs,
        grad_variables,
        "variables",
        "grad_variables",
        sequence=isinstance(variables, (list, tuple)),
    )
    capture: list[Variable] | None = None
    non_leaves: list[tuple[Variable, tuple[Node, int]]] = []
    if inputs is not None:
        wanted = _as_variables(inputs, "inputs")
        if not wanted:
            raise GraphError(
                "'inputs' argument to backward() cannot be empty: pass None for all leaves"
            )
        for i, var in enumerate(wanted):
            if not var.requires_grad:
                raise GraphError(f"inputs[{i}] ({var!r}) does not require grad")
        # A non-leaf among them gets its gradient in .grad too (PyTorch >= 1.10).
        capture = [var for var in wanted if var.grad_fn is None]
        non_leaves = [
            (var, (node, var.output_nr)) for var in wanted if (node := var.grad_fn) is not None
        ]
    engine = Engine(
        executor or current_executor(),
        create_graph=create_graph,
        keep_graph=create_graph if retain_graph is None else retain_graph,
        listeners=listeners,
    )
    await engine.run(
        roots, capture_leaves=capture, capture_outputs=[target for _, target in non_leaves]
    )
    for var, target in non_leaves:
        g = engine.captured.get(target)
        if g is not None:
            engine.stage(var, g)
    engine.commit()


def _target(var: Variable) -> Variable | tuple[Node, int]:
    """Where the engine captures ``var``'s gradient: the leaf itself, or its node's output."""
    node = var.grad_fn
    return var if node is None else (node, var.output_nr)


@must_await("grad")
async def grad(
    outputs: Variables,
    inputs: Variables,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    *,
    materialize_grads: bool = False,
    executor: Executor | None = None,
    listeners: Iterable[Listener] = (),
) -> tuple[Variable | None, ...]:
    """Return the gradients of ``outputs`` with respect to ``inputs``; leaves' ``.grad`` is
    untouched.

    ``inputs`` may be leaves or intermediate variables. An input that the
    outputs do not depend on gets None with ``allow_unused=True`` and raises
    ``GraphError`` otherwise; with ``materialize_grads=True`` (which implies
    ``allow_unused``) it gets a zero like its data instead (None for text, which has
    no zero), as in PyTorch. A variable on the way that called ``retain_grad()`` gets its
    gradient in ``.grad``, as in PyTorch (committed only if the pass succeeds). Other
    arguments as in :func:`backward`.

    Example::

        x = Parameter(3.0)
        y = Square.apply(x)
        (dx,) = await grad(y, x)
        print(dx.data, x.grad)                       # 6.0 None
    """
    if allow_unused is None:
        allow_unused = materialize_grads
    elif materialize_grads and not allow_unused:
        raise ValueError(
            "grad(): materialize_grads=True needs allow_unused=True (or allow_unused left out)"
        )
    outs = _as_variables(outputs, "outputs")
    if not outs:
        raise GraphError("grad() got no outputs to differentiate")
    ins = _as_variables(inputs, "inputs")
    if not ins:
        raise GraphError("grad requires non-empty inputs: grad() needs at least one input")
    roots = _roots(
        outs, grad_outputs, "outputs", "grad_outputs", sequence=isinstance(outputs, (list, tuple))
    )
    leaves: list[Variable] = []
    node_outputs: list[tuple[Node, int]] = []
    for i, var in enumerate(ins):
        if not var.requires_grad:
            raise GraphError(
                f"One of the differentiated Variables does not require grad: inputs[{i}] ({var!r})"
            )
        if var.grad_fn is None:
            leaves.append(var)
        else:
            node_outputs.append((var.grad_fn, var.output_nr))
    engine = Engine(
        executor or current_executor(),
        create_graph=create_graph,
        keep_graph=create_graph if retain_graph is None else retain_graph,
        listeners=listeners,
    )
    await engine.run(roots, capture_leaves=leaves, capture_outputs=node_outputs, accumulate=False)
    engine.commit()  # retained variables only: grad() stages no leaf
    result: list[Variable | None] = []
    for i, var in enumerate(ins):
        g = engine.captured.get(_target(var))
        if g is None and materialize_grads:
            zero = zero_template(var.data)
            g = None if zero is None else Variable(make_zero(zero))
        if g is None and not allow_unused:
            raise GraphError(
                f"One of the differentiated Variables appears to not have been used in the "
                f"graph: no gradient reached inputs[{i}] ({var!r}). Set allow_unused=True if "
                f"this is the desired behavior."
            )
        result.append(g)
    return tuple(result)
