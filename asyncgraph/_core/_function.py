"""Function: the extension point. Subclass it with a forward and a backward."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal, TypeVar

from asyncgraph._exceptions import GraphError

from ._grad_mode import _GRAD_ENABLED
from ._graph import _ORDER, Edge, Node, Seq, next_seq, zero_template
from ._remote_forwards import ForwardExecutor, current_forward_executor
from ._variable import Variable

__all__ = ["Function", "FunctionCtx", "once_differentiable"]


class FunctionCtx:
    """The ``ctx`` that forward fills and backward reads.

    ``ctx.save_for_backward(*variables)`` keeps Variables for backward
    (``ctx.saved_variables``; freed after a backward without
    ``retain_graph=True``). ``ctx.needs_input_grad[i]`` tells whether input
    ``i`` needs a gradient: whether it is a Variable that requires grad, as in
    PyTorch, even under ``no_grad()``; ``ctx.recorded`` tells whether this
    application is recorded at all (so that backward can run).
    ``ctx.mark_dirty(x)`` declares an input that forward changed in place.
    Any other attribute may be set freely.

    ``function_name``, ``marked_dirty``, ``marked_non_differentiable`` and ``raw_saved``
    are for executors that move a ctx to another process (the fleet) and for tools that
    show a graph; a forward or a backward needs none of them.

    Example::

        class Square(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return Variable(x.data * x.data)

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_variables
                return Variable(2 * x.data * grad.data)
    """

    def __init__(self, *, function_name: str = "") -> None:
        self._saved: tuple[Any, ...] | None = ()
        self._non_differentiable: tuple[Variable, ...] = ()
        self._dirty: tuple[Variable, ...] = ()
        # Each saved variable's version when the node was recorded (see mark_dirty).
        self._saved_versions: tuple[int | None, ...] = ()
        self._function_name = function_name
        self._seq: Seq = ()
        self.needs_input_grad: tuple[bool, ...] = ()
        self._recorded = False
        self._materialize_grads = True

    def save_for_backward(self, *variables: Any) -> None:
        for i, item in enumerate(variables):
            if item is not None and not isinstance(item, Variable):
                raise TypeError(
                    f"save_for_backward expects Variables or None; argument {i} is "
                    f"{type(item).__name__} ({item!r:.60}). Store plain values as ctx attributes."
                )
        self._saved = variables

    @property
    def recorded(self) -> bool:
        """Whether this application is recorded in the graph (grad mode on and an input
        requires grad), so that its backward can run.

        ``needs_input_grad`` follows each input's ``requires_grad`` even under
        ``no_grad()``, as in PyTorch; a forward that prepares something only backward
        uses (a feedback model to resolve, say) reads ``ctx.recorded`` instead. PyTorch
        has no counterpart: its forwards cannot tell.
        """
        return self._recorded

    @property
    def saved_variables(self) -> tuple[Any, ...]:
        if self._saved is None:
            raise GraphError(
                f"Trying to backward through the graph a second time (or to access saved "
                f"variables of {self._function_name} after they were freed). Saved "
                f"variables are freed after backward; specify retain_graph=True on the "
                f"first backward if you need to backward through the graph again."
            )
        for var, version in zip(self._saved, self._saved_versions, strict=False):
            if var is not None and var._version != version:
                raise GraphError(
                    f"one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: {var!r}, saved by {self._function_name}, is at "
                    f"version {var._version}; expected version {version} instead. A Function "
                    f"marked it dirty (ctx.mark_dirty) after {self._function_name} saved it: "
                    f"apply that Function to a copy (a new Variable) or after the backward"
                )
        return self._saved

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """Alias of ``saved_variables``, so Functions ported from PyTorch run unchanged."""
        return self.saved_variables

    def set_materialize_grads(self, value: bool) -> None:
        """Whether an output that gets no gradient reaches ``backward`` as a zero (True, the
        default, as in PyTorch) or as None. Only numbers and numpy arrays have a zero
        (of the output's type, shape and dtype); a text output gets None either way."""
        self._materialize_grads = bool(value)

    def mark_non_differentiable(self, *outputs: Variable) -> None:
        """Declare outputs that get no gradient: backward receives a zero for them (None for
        text, or after ``set_materialize_grads(False)``), as in PyTorch."""
        for out in outputs:
            if not isinstance(out, Variable):
                raise TypeError(f"mark_non_differentiable expects outputs, got {out!r:.60}")
        self._non_differentiable = self._non_differentiable + tuple(outputs)

    def mark_dirty(self, *variables: Variable) -> None:
        """Declare inputs that forward changed in place (PyTorch's ``ctx.mark_dirty``).

        Each must be an input that forward also returns, as is: that Variable object
        becomes the output (its history now ends at this node; its ``.grad`` is reset,
        a ``retain_grad()`` follows it) instead of a copy. Its version goes up by one, so
        that a node that saved it before raises when its backward reads
        ``ctx.saved_variables``, instead of computing from the changed value. A leaf that
        requires grad cannot be changed in place (``GraphError``; change a copy, or do it
        under ``no_grad()``). Call it once, in forward; a later call replaces the first.
        """
        for i, var in enumerate(variables):
            if not isinstance(var, Variable):
                raise TypeError(
                    f"mark_dirty expects the input Variables forward changed in place; "
                    f"argument {i} is {type(var).__name__} ({var!r:.60})"
                )
        self._dirty = variables

    def _free(self) -> None:
        """Free the saved variables, if there are any (as in PyTorch, a node that saved
        nothing can be run again after a backward without retain_graph)."""
        if self._saved:
            self._saved = None

    # -- For executors that move a ctx to another process, and tools that show a graph:
    # the ctx's state out and back in, under names the import contracts can see.

    @property
    def function_name(self) -> str:
        """The name of the Function this ctx belongs to ("" for a ctx made by hand): for
        messages."""
        return self._function_name

    @property
    def marked_dirty(self) -> tuple[Variable, ...]:
        """The Variables forward passed to ``mark_dirty`` (PyTorch's ``ctx.dirty_tensors``)."""
        return self._dirty

    @property
    def marked_non_differentiable(self) -> tuple[Variable, ...]:
        """The outputs forward passed to ``mark_non_differentiable`` (PyTorch's
        ``ctx.non_differentiable``)."""
        return self._non_differentiable

    @property
    def raw_saved(self) -> tuple[Any, ...] | None:
        """What ``save_for_backward`` kept, as it is: None once a backward freed it, and
        unchecked (``saved_variables`` raises instead, and checks versions).

        Setting it restores saved variables sent from another process (each a Variable or
        None, or None for a ctx freed there), with no version to check against.
        """
        return self._saved

    @raw_saved.setter
    def raw_saved(self, saved: tuple[Any, ...] | None) -> None:
        if saved is not None:
            saved = tuple(saved)
            for v in saved:
                if v is not None and not isinstance(v, Variable):
                    raise TypeError(f"raw_saved holds Variables or None, got {v!r:.80}")
        self._saved = saved
        self._saved_versions = ()


class Function:
    """Base class of differentiable operations.

    Subclass and define static methods:

    - ``forward(ctx, *args, **kwargs)``, or ``forward(*args, **kwargs)`` plus
      ``setup_context(ctx, inputs, output)``, returning one Variable or a tuple
      (raw data is wrapped in a Variable; when no gradient reaches such an output,
      backward receives None for it, whatever the value, as PyTorch passes None for a
      non-Tensor output);
    - ``backward(ctx, *grad_outputs)``: one gradient (Variable or None) per
      forward output in, one gradient (Variable, raw data or None) per forward
      input out. The inputs are the positional arguments, then the keyword
      arguments passed, in the order forward's signature lists them (those taken
      by ``**kwargs`` last, in call order), whatever order the caller wrote;
      ``ctx.needs_input_grad`` has one entry per input in that order.

    Any of them may be ``async def``. ``apply`` returns the output directly
    when forward (and setup_context) are synchronous, an awaitable otherwise.
    Forward runs with grad disabled. Class attributes tune where backward runs:
    ``blocking = True`` runs a synchronous backward in a worker thread (sync I/O,
    heavy CPU); ``dispatch = "remote"`` lets a distributed executor send it to a
    worker, and the forward too when it is async and applied inside
    ``remote_forwards(executor)``. ``ctx_types = {"options": MyOptions}`` declares ctx attributes that hold
    a typed record instead of plain data: one travels to a worker as
    ``value.to_data()`` and is rebuilt there with ``MyOptions.from_data(data)``, the
    class coming from this declaration, never from the message.
    ``option_keywords = frozenset({"model", ...})`` names keyword arguments that
    configure the call instead of feeding it: forward receives them as usual, but they
    are not inputs (no entry in ``ctx.needs_input_grad`` or in setup_context's
    ``inputs``, no gradient from backward), and a Variable given to one is a
    ``TypeError`` (it would leave the graph unseen).

    Example::

        class Double(Function):
            @staticmethod
            def forward(ctx, x):
                return Variable(x.data * 2)

            @staticmethod
            def backward(ctx, grad):
                return Variable(grad.data * 2)

        y = Double.apply(x)
    """

    dispatch: ClassVar[Literal["local", "remote"]] = "local"
    blocking: ClassVar[bool] = False
    remote_name: ClassVar[str | None] = None
    ctx_types: ClassVar[Mapping[str, type[Any]]] = MappingProxyType({})
    option_keywords: ClassVar[frozenset[str]] = frozenset()

    _forward_is_async: ClassVar[bool] = False
    _setup_is_async: ClassVar[bool] = False
    _uses_setup_context: ClassVar[bool] = False
    _backward_is_async: ClassVar[bool] = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Function:
        raise TypeError(
            f"{cls.__name__} is a Function and is not instantiated; "
            f"call {cls.__name__}.apply(...) instead"
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.dispatch not in ("local", "remote"):
            raise ValueError(
                f"{cls.__name__}.dispatch must be 'local' or 'remote', got {cls.dispatch!r}"
            )
        for name, kind in cls.ctx_types.items():
            if not (
                isinstance(name, str)
                and isinstance(kind, type)
                and callable(getattr(kind, "to_data", None))
                and callable(getattr(kind, "from_data", None))
            ):
                raise TypeError(
                    f"{cls.__name__}.ctx_types maps ctx attribute names to classes with "
                    f"to_data() and a from_data(data) classmethod; {name!r}: {kind!r} is not one"
                )
        options = cls.option_keywords
        if isinstance(options, str) or not all(isinstance(n, str) for n in options):
            raise TypeError(
                f"{cls.__name__}.option_keywords names keyword arguments: a set of str, "
                f"e.g. frozenset({{'model'}}); got {options!r:.80}"
            )
        cls.option_keywords = frozenset(options)  # a tuple or list given: one set
        cls._uses_setup_context = cls.setup_context is not Function.setup_context
        cls._forward_is_async = inspect.iscoroutinefunction(cls.forward)
        cls._setup_is_async = inspect.iscoroutinefunction(cls.setup_context)
        cls._backward_is_async = inspect.iscoroutinefunction(cls.backward)
        try:
            signature: inspect.Signature | None = inspect.signature(cls.forward)
        except (TypeError, ValueError):  # builtins without a signature
            signature = None
        cls._forward_signature = signature
        params = list(signature.parameters) if signature is not None else []
        cls._kwarg_order = {name: i for i, name in enumerate(params)}

    _kwarg_order: ClassVar[dict[str, int]] = {}
    _forward_signature: ClassVar[inspect.Signature | None] = None

    @staticmethod
    def _bound_inputs(bound: inspect.BoundArguments, options: frozenset[str]) -> tuple[Any, ...]:
        """Bound arguments flattened in signature order (``*args`` and ``**kwargs`` spread),
        but ``options``."""
        inputs: list[Any] = []
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                inputs.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                inputs.extend(v for k, v in value.items() if k not in options)
            elif name not in options:
                inputs.append(value)
        return tuple(inputs)

    @classmethod
    def _inputs(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Positional arguments, then keyword arguments in forward's signature order.

        Keywords that forward takes through ``**kwargs`` follow, in call order
        (the order forward itself sees them in). With ``setup_context``, forward's
        signature is bound first with its defaults applied (as PyTorch does), so
        ``forward(x, scale=2.0)`` applied as ``F.apply(x)`` has inputs ``(x, 2.0)``.
        The ``option_keywords`` are left out.
        """
        options = cls.option_keywords
        for name in options.intersection(kwargs):
            if isinstance(kwargs[name], Variable):
                raise TypeError(
                    f"{cls.__name__}: option {name}= must be plain data, got a Variable "
                    f"({kwargs[name]!r:.80}); pass its .data, or pass the Variable as an input"
                )
        if cls._uses_setup_context and cls._forward_signature is not None:
            try:
                bound = cls._forward_signature.bind(*args, **kwargs)
            except TypeError:
                pass  # forward itself raises the clear error when it is called
            else:
                bound.apply_defaults()
                return cls._bound_inputs(bound, options)
        kwargs = {name: value for name, value in kwargs.items() if name not in options}
        if not kwargs:
            return args
        order = cls._kwarg_order
        late = len(order)
        names = sorted(kwargs, key=lambda name: order.get(name, late))
        return args + tuple(kwargs[name] for name in names)

    @staticmethod
    def forward(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a Function subclass must define a static forward()")

    @staticmethod
    def setup_context(ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        raise NotImplementedError("a Function subclass must define a static backward()")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run forward and, when grad mode is on and an input requires grad, record it.

        Inside ``remote_forwards(executor)``, a ``dispatch = "remote"`` Function's async
        forward runs through ``executor.apply`` (a synchronous one raises ``TypeError``).
        """
        if cls is Function:
            raise TypeError("Function.apply is called on a subclass: MyFunction.apply(...)")
        if cls.dispatch == "remote":
            executor = current_forward_executor()
            if executor is not None:
                return cls._apply_remote(executor, args, kwargs)
        inputs = cls._inputs(args, kwargs)
        # Grad mode is read here, when apply is called, even if the result is awaited later.
        ctx, record = cls._prepare(inputs)
        if cls._forward_is_async or cls._setup_is_async:
            return cls._apply_async(args, kwargs, ctx, record)
        token = _GRAD_ENABLED.set(False)
        try:
            if cls._uses_setup_context:
                output = cls.forward(*args, **kwargs)
                cls.setup_context(ctx, inputs, output)
            else:
                output = cls.forward(ctx, *args, **kwargs)
        finally:
            _GRAD_ENABLED.reset(token)
        return cls._record(ctx, inputs, output, record)

    @classmethod
    async def _apply_async(
        cls, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: FunctionCtx, record: bool
    ) -> Any:
        inputs = cls._inputs(args, kwargs)
        token = _GRAD_ENABLED.set(False)
        try:
            if cls._uses_setup_context:
                output = await _maybe_await(cls.forward(*args, **kwargs))
                await _maybe_await(cls.setup_context(ctx, inputs, output))
            else:
                output = await _maybe_await(cls.forward(ctx, *args, **kwargs))
        finally:
            _GRAD_ENABLED.reset(token)
        return cls._record(ctx, inputs, output, record)

    @classmethod
    def _apply_remote(
        cls, executor: ForwardExecutor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``executor.apply(cls, ...)`` as an awaitable, with what ``apply`` reads at call time.

        Grad mode and the node's place in graph order are those of the moment ``apply``
        was called, as in-process: the node's seq extends the one taken here, so it sorts
        exactly where the in-process node would, whenever the awaitable runs.
        """
        if not (cls._forward_is_async or cls._setup_is_async):
            raise TypeError(
                f"{cls.__name__}.forward is synchronous, so {cls.__name__}.apply returns its "
                f"output at once and cannot wait for a worker; inside remote_forwards(...) "
                f"make the forward `async def` to run it on the workers, or give "
                f"{cls.__name__} dispatch = 'local' to run it here"
            )
        return _on_executor(executor, cls, args, kwargs, _GRAD_ENABLED.get(), next_seq())

    @classmethod
    def application(
        cls, args: tuple[Any, ...], kwargs: dict[str, Any], *, recorded: bool | None = None
    ) -> Application:
        """This Function applied to ``args`` and ``kwargs``, in the steps ``apply`` takes at
        once, for an executor that runs the forward in another process (see
        ``Application``). ``recorded``: the caller's decision, on the process that runs
        the forward (None: grad mode and the inputs decide, as in ``apply``)."""
        return Application(cls, args, kwargs, recorded)

    @classmethod
    def _prepare(cls, inputs: tuple[Any, ...]) -> tuple[FunctionCtx, bool]:
        ctx = FunctionCtx()
        ctx._function_name = cls.__name__
        ctx._seq = next_seq()
        # As PyTorch: each input's requires_grad, whether or not the node is recorded.
        needs = tuple(isinstance(v, Variable) and v._requires_grad for v in inputs)
        record = _GRAD_ENABLED.get() and any(needs)
        ctx.needs_input_grad = needs
        ctx._recorded = record
        return ctx, record

    @classmethod
    def _record(cls, ctx: FunctionCtx, inputs: tuple[Any, ...], output: Any, record: bool) -> Any:
        """What forward returned, as the caller receives it: Variables, recorded as the
        outputs of a new node of the graph when ``record``."""
        is_tuple = isinstance(output, tuple)
        outputs = output if is_tuple else (output,)
        if not outputs:
            raise TypeError(f"{cls.__name__}.forward returned an empty tuple; return a Variable")
        if ctx._dirty:
            _check_dirty(cls.__name__, ctx, inputs, outputs, record)
        if record:
            result = _recorded_outputs(cls, ctx, inputs, outputs)
        else:
            result = tuple([o if isinstance(o, Variable) else Variable(o) for o in outputs])
        return result if is_tuple else result[0]


def _recorded_outputs(
    fn: type[Function], ctx: FunctionCtx, inputs: tuple[Any, ...], outputs: tuple[Any, ...]
) -> tuple[Variable, ...]:
    """Record one application of ``fn`` as a node, and return its outputs (each the
    node's output, but for the non-differentiable ones)."""
    node = _node(fn, ctx, inputs, len(outputs))
    result = tuple([_output(node, i, out, inputs) for i, out in enumerate(outputs)])
    node.output_roles = tuple([o.role for o in result])
    if ctx._materialize_grads:
        node.zeros = _zero_templates(outputs, result)
    if ctx._saved:  # versions after this node's own in-place changes (mark_dirty)
        ctx._saved_versions = tuple([None if v is None else v._version for v in ctx._saved])
    return result


def _node(fn: type[Function], ctx: FunctionCtx, inputs: tuple[Any, ...], num_outputs: int) -> Node:
    """The node of one application of ``fn``: per input, the edge its gradient flows
    along (to the node that computed it, or to the leaf itself; None when it needs none)."""
    edges: list[Edge | None] = []
    for v in inputs:
        if isinstance(v, Variable) and v._requires_grad:
            grad_fn = v.grad_fn
            edges.append((grad_fn, v._output_nr) if grad_fn is not None else (v, 0))
        else:
            edges.append(None)
    return Node(
        fn,
        ctx,
        tuple(edges),
        ctx.needs_input_grad,
        tuple([v.role if isinstance(v, Variable) else "" for v in inputs]),
        num_outputs,
        ctx._seq,
        tuple([isinstance(v, Variable) for v in inputs]),
    )


def _zero_templates(
    outputs: tuple[Any, ...], result: tuple[Variable, ...]
) -> tuple[Any, ...] | None:
    """Per output, how to make its zero gradient (``ctx.set_materialize_grads``); None when
    no output has one. A raw value forward returned (not a Variable) has no zero: PyTorch
    passes None for a non-Tensor output, whatever the value."""
    zeros = tuple(
        [
            zero_template(out.data) if isinstance(raw, Variable) else None
            for raw, out in zip(outputs, result, strict=True)
        ]
    )
    return zeros if any(z is not None for z in zeros) else None


def _is_in(var: Any, group: tuple[Any, ...]) -> bool:
    return any(var is item for item in group)


def _output(node: Node, i: int, returned: Any, inputs: tuple[Any, ...]) -> Variable:
    """Output ``i`` of a recorded node, as the caller receives it (PyTorch's set_history)."""
    if not isinstance(returned, Variable):
        out = Variable(returned)
    elif returned._grad_fn is not None or returned._requires_grad or _is_in(returned, inputs):
        # Not a fresh Variable (the usual case, which takes the node as it is): an input,
        # or one with a history of its own (an input changed in place included).
        return _output_of_known(node, i, returned, inputs)
    else:
        out = returned
    non_diff = node.ctx._non_differentiable
    if non_diff and _is_in(out, non_diff):
        return out
    _set_history(out, node, i)
    return out


def _output_of_known(node: Node, i: int, returned: Variable, inputs: tuple[Any, ...]) -> Variable:
    """Output ``i`` when forward returned an input, or a Variable with a history of its own."""
    ctx = node.ctx
    non_diff = ctx._non_differentiable
    differentiable = not (non_diff and _is_in(returned, non_diff))
    if ctx._dirty and _is_in(returned, ctx._dirty) and _is_in(returned, inputs):
        if differentiable:
            _rebase(returned, node, i)  # changed in place: the same object, a new history
            return returned
        if returned._grad_fn is None and not returned._requires_grad:
            return returned  # changed in place and needs no gradient: as it is
    # Give the output its own identity, so that the input keeps its history.
    out = Variable(returned.data, role=returned.role)
    if differentiable:
        _set_history(out, node, i)
    return out


def _set_history(var: Variable, node: Node, i: int) -> None:
    """Make ``var`` output ``i`` of ``node``."""
    var._grad_fn = node
    var._output_nr = i
    var._requires_grad = True


def _rebase(var: Variable, node: Node, i: int) -> None:
    """Make an input that forward changed in place output ``i`` of ``node`` (PyTorch's
    rebase_history): its ``.grad`` is reset, a ``retain_grad()`` moves along; hooks
    registered before stay on the old node (they see the old value's gradient)."""
    old = var._grad_fn
    if old is not None and old.retained:
        ref = old.retained.get(var._output_nr)
        if ref is not None and ref() is var:
            del old.retained[var._output_nr]
            if node.retained is None:
                node.retained = {}
            node.retained[i] = ref
    var._grad = None
    _set_history(var, node, i)


def _check_dirty(
    name: str, ctx: FunctionCtx, inputs: tuple[Any, ...], outputs: tuple[Any, ...], record: bool
) -> None:
    """PyTorch's rules for ``ctx.mark_dirty``, then each dirty variable's version goes up."""
    dirty = ctx._dirty
    if not all(_is_in(var, outputs) for var in dirty):
        raise GraphError(
            f"Some elements marked as dirty during the forward method were not returned as "
            f"output. The inputs that are modified inplace must all be outputs of the "
            f"Function ({name}.forward): return each Variable passed to ctx.mark_dirty"
        )
    if record:
        for var in dirty:
            if _is_in(var, ctx._non_differentiable):
                continue
            if not _is_in(var, inputs):
                warnings.warn(
                    f"Only input Variables should be given to ctx.mark_dirty(). If a "
                    f"Variable is not an input, there is no need to pass it to mark_dirty() "
                    f"({name}.forward, {var!r:.60})",
                    stacklevel=4,
                )
            elif var.grad_fn is None and var._requires_grad:
                raise GraphError(
                    f"a leaf Variable that requires grad has been used in an in-place "
                    f"operation: {name}.forward marked {var!r} dirty. Change a copy (a new "
                    f"Variable) instead, or do it under no_grad()"
                )
    for var in {id(v): v for v in dirty}.values():
        var._version += 1


async def _on_executor(
    executor: ForwardExecutor,
    fn: type[Function],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grad_enabled: bool,
    seq: Seq,
) -> Any:
    grad_token = _GRAD_ENABLED.set(grad_enabled)
    order_token = _ORDER.set(seq)
    try:
        return await executor.apply(fn, *args, **kwargs)
    finally:
        _ORDER.reset(order_token)
        _GRAD_ENABLED.reset(grad_token)


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


_Backward = TypeVar("_Backward", bound=Callable[..., Any])


def once_differentiable(fn: _Backward) -> _Backward:
    """Mark a ``backward`` that works on raw data: it can be differentiated once, not twice.

    The decorated backward runs with grad disabled, as PyTorch's. Under
    ``create_graph=True`` with gradients that require grad, its results come out of a
    ``DelayedError`` node instead of having no history: differentiating through them
    again raises ``BackwardError`` ("trying to differentiate twice a function that was
    marked with @once_differentiable"), naming the backward, instead of silently giving
    no gradient. Sync or ``async def`` backwards alike; put it under ``@staticmethod``.

    Example::

        class Cube(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return Variable(x.data**3)

            @staticmethod
            @once_differentiable
            def backward(ctx, grad):
                (x,) = ctx.saved_variables
                return 3 * x.data**2 * grad.data     # numbers: no graph to differentiate

        x = Parameter(2.0)
        await Cube.apply(x).backward(Variable(1.0, requires_grad=True), create_graph=True)
        print(x.grad.data, x.grad.grad_fn.name)      # 12.0 DelayedError
    """
    what = getattr(fn, "__qualname__", repr(fn))
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(ctx: Any, *grads: Any) -> Any:
            token = _GRAD_ENABLED.set(False)
            try:
                result = await fn(ctx, *grads)
            finally:
                _GRAD_ENABLED.reset(token)
            return _delay_error(what, result, grads)

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        token = _GRAD_ENABLED.set(False)
        try:
            result = fn(ctx, *grads)
        finally:
            _GRAD_ENABLED.reset(token)
        return _delay_error(what, result, grads)

    return wrapper  # type: ignore[return-value]


def _delay_error(what: str, result: Any, grads: tuple[Any, ...]) -> Any:
    """``result`` as it is, or behind a ``DelayedError`` node when the pass records
    (create_graph) and a gradient ``backward`` received requires grad (PyTorch's rule;
    it cannot see the saved variables a backward used)."""
    if not _GRAD_ENABLED.get():
        return result
    if not any(isinstance(g, Variable) and g._requires_grad for g in grads):
        return result
    is_tuple = isinstance(result, tuple)
    items = result if is_tuple else (result,)
    if all(item is None for item in items):
        return result
    # Fresh leaves that require grad, so that the DelayedError node records an edge to
    # each; None stays None (an input that needs no gradient).
    fakes = [
        None
        if item is None
        else Variable(item.data if isinstance(item, Variable) else item, requires_grad=True)
        for item in items
    ]
    outputs = DelayedError.apply(*fakes)
    outputs[0].grad_fn.ctx.what = what
    guarded = tuple(None if item is None else out for item, out in zip(items, outputs, strict=True))
    return guarded if is_tuple else guarded[0]


class DelayedError(Function):
    """What a ``@once_differentiable`` backward's gradients come out of under create_graph:
    passes them through, and raises when differentiated (PyTorch's DelayedError)."""

    @staticmethod
    def forward(ctx: Any, *grads: Variable | None) -> tuple[Variable | None, ...]:
        return tuple(None if g is None else Variable(g.data, role=g.role) for g in grads)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise GraphError(
            f"trying to differentiate twice a function that was marked with "
            f"@once_differentiable ({getattr(ctx, 'what', '?')}): its backward works on raw "
            f"data, so its gradients have no history to differentiate. Write that backward "
            f"with Functions (and drop @once_differentiable) to take a second derivative"
        )


class Application:
    """One application of a Function whose forward runs in another process (an executor's
    worker), in the steps ``apply`` takes at once.

    ``MyFunction.application(args, kwargs)`` holds what ``apply`` reads at call time:
    ``inputs`` (the arguments in forward's signature order), a fresh ``ctx`` (its
    ``needs_input_grad`` and ``function_name`` set) and ``recorded`` (whether the node
    is recorded). On the process that runs the forward, ``run_forward`` runs forward (and
    ``setup_context``) on ``ctx``; on the caller's, once ``ctx`` is restored from there,
    ``finish(output)`` records the node with the output computed there and returns what
    ``apply`` would have.
    """

    __slots__ = ("args", "ctx", "function", "inputs", "kwargs", "recorded")

    def __init__(
        self,
        function: type[Function],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recorded: bool | None,
    ) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.inputs = function._inputs(args, kwargs)
        self.ctx, record = function._prepare(self.inputs)
        if recorded is not None:
            record = self.ctx._recorded = recorded
        self.recorded = record

    async def run_forward(self, call: Callable[..., Awaitable[Any]]) -> Any:
        """Forward's output, each method run by ``call(method, *args, **kwargs)`` (which
        awaits it, or runs it where the executor runs synchronous methods)."""
        fn = self.function
        if fn._uses_setup_context:
            output = await call(fn.forward, *self.args, **self.kwargs)
            await call(fn.setup_context, self.ctx, self.inputs, output)
            return output
        return await call(fn.forward, self.ctx, *self.args, **self.kwargs)

    def finish(self, output: Any) -> Any:
        """Record the node with ``output`` (a Variable, raw data, or a tuple of them, as
        forward returns) and return it as ``apply`` would."""
        return self.function._record(self.ctx, self.inputs, output, self.recorded)
