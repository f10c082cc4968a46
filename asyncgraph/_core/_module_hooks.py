"""Module hooks, as PyTorch's ``nn.Module``: forward pre-hooks, forward hooks, and full
backward (pre-)hooks, each registered with a handle that removes it.

A full backward hook needs the gradients with respect to a call's inputs and outputs. As
PyTorch's ``BackwardHook``, each call of a Module with backward hooks passes its Variable
inputs, then its Variable outputs, through an identity Function
(``BackwardHookFunction``): the outputs' node sees the gradients of the outputs (the
backward pre-hooks run there), the inputs' node, which runs once every gradient of the
inputs is known, calls the hooks with both.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from ._function import Function
from ._grad_mode import is_grad_enabled
from ._graph import _HOOK_KEYS, RemovableHandle, new_hook_dict
from ._variable import Variable

__all__ = ["BackwardHookFunction", "ModuleHooks"]


class _Hook(NamedTuple):
    fn: Callable[..., Any]
    with_kwargs: bool = False
    always_call: bool = False


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _pack(index: list[int], values: tuple[Any, ...], size: int) -> tuple[Any, ...]:
    """``values`` at positions ``index`` of a tuple of ``size``, None elsewhere."""
    out: list[Any] = [None] * size
    for i, value in zip(index, values, strict=True):
        out[i] = value
    return tuple(out)


class _BackwardHook:
    """One call's backward hooks (PyTorch's ``torch.utils.hooks.BackwardHook``)."""

    def __init__(self, module: Any, hooks: list[_Hook], pre_hooks: list[_Hook]) -> None:
        self.module = module
        self.hooks = hooks
        self.pre_hooks = pre_hooks
        self.grad_outputs: tuple[Any, ...] | None = None
        self.n_inputs = 0
        self.n_outputs = 0
        self.input_index: list[int] | None = None
        self.output_index: list[int] | None = None

    def _wrap(self, kind: str, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[int] | None]:
        index = [i for i, v in enumerate(values) if isinstance(v, Variable)]
        if not (is_grad_enabled() and any(values[i].requires_grad for i in index)):
            return values, None
        wrapped = BackwardHookFunction.apply(self, kind, *(values[i] for i in index))
        out = list(values)
        for i, var in zip(index, wrapped, strict=True):
            out[i] = var
        return tuple(out), index

    def setup_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.n_inputs = len(args)
        args, self.input_index = self._wrap("inputs", args)
        return args

    def setup_outputs(self, result: Any) -> Any:
        if not isinstance(result, (Variable, tuple)):
            warnings.warn(
                f"For backward hooks to be called, module output should be a Variable or a "
                f"tuple of Variables but received {type(result).__name__} "
                f"({type(self.module).__name__}.forward)",
                stacklevel=4,
            )
        is_tuple = isinstance(result, tuple)
        outputs = result if is_tuple else (result,)
        self.n_outputs = len(outputs)
        outputs, self.output_index = self._wrap("outputs", outputs)
        return outputs if is_tuple else outputs[0]

    async def outputs_backward(self, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """The gradients of the outputs arrive: run the pre-hooks, keep them for the hooks."""
        assert self.output_index is not None
        grad_outputs = _pack(self.output_index, grads, self.n_outputs)
        for hook in self.pre_hooks:
            result = await _maybe_await(hook.fn(self.module, grad_outputs))
            if result is None:
                continue
            if not isinstance(result, tuple) or len(result) != len(grad_outputs):
                got = len(result) if isinstance(result, tuple) else type(result).__name__
                raise RuntimeError(
                    f"Backward pre hook returned an invalid number of grad_output, got {got}, "
                    f"but expected {len(grad_outputs)}: return a tuple with one gradient (or "
                    f"None) per output of {type(self.module).__name__}.forward"
                )
            grad_outputs = result
        if self.input_index is None:
            # No input requires grad: the hooks run now, with None for every input.
            self.grad_outputs = grad_outputs
            grad_inputs = (None,) * self.n_inputs
            for hook in self.hooks:
                result = await _maybe_await(hook.fn(self.module, grad_inputs, grad_outputs))
                if result is not None and not (
                    isinstance(result, tuple) and all(g is None for g in result)
                ):
                    raise RuntimeError(
                        "Backward hook for Modules where no input requires gradient should "
                        "always return None or None for all gradients."
                    )
            self.grad_outputs = None
        else:
            self.grad_outputs = grad_outputs
        return tuple(grad_outputs[i] for i in self.output_index)

    async def inputs_backward(self, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """Every gradient of the inputs is known: call the hooks with both."""
        if self.grad_outputs is None:
            # The gradient reached the inputs without passing through the outputs (a
            # second derivative, say): no hook to call, as in PyTorch.
            return grads
        assert self.input_index is not None
        grad_inputs = _pack(self.input_index, grads, self.n_inputs)
        for hook in self.hooks:
            result = await _maybe_await(hook.fn(self.module, grad_inputs, self.grad_outputs))
            if result is None:
                continue
            if not isinstance(result, tuple) or len(result) != len(grad_inputs):
                got = len(result) if isinstance(result, tuple) else type(result).__name__
                raise RuntimeError(
                    f"Backward hook returned an invalid number of grad_input, got {got}, but "
                    f"expected {len(grad_inputs)}: return a tuple with one gradient (or None) "
                    f"per positional argument of {type(self.module).__name__}.forward"
                )
            grad_inputs = result
        self.grad_outputs = None
        return tuple(grad_inputs[i] for i in self.input_index)


class BackwardHookFunction(Function):
    """The identity a Module call with backward hooks passes its inputs and outputs through
    (PyTorch's ``BackwardHookFunction``); its backward runs the hooks."""

    @staticmethod
    def forward(ctx: Any, hook: _BackwardHook, kind: str, *values: Variable) -> tuple[Any, ...]:
        ctx.hook, ctx.kind = hook, kind
        # An unused input or output gets None, not an invented zero: registering a hook
        # must not change the gradients (PyTorch's materializes zeros here).
        ctx.set_materialize_grads(False)
        outputs = tuple(Variable(v.data, role=v.role) for v in values)
        ctx.mark_non_differentiable(
            *(out for v, out in zip(values, outputs, strict=True) if not v.requires_grad)
        )
        return outputs

    @staticmethod
    async def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        hook: _BackwardHook = ctx.hook
        if ctx.kind == "outputs":
            passed = await hook.outputs_backward(grads)
        else:
            passed = await hook.inputs_backward(grads)
        return (None, None, *passed)


def _add(hooks: dict[int, Any], hook: _Hook, prepend: bool) -> RemovableHandle:
    if not callable(hook.fn):
        raise TypeError(f"a Module hook must be callable, got {hook.fn!r:.60}")
    key = next(_HOOK_KEYS)
    if prepend:
        rest = list(hooks.items())
        hooks.clear()
        hooks[key] = hook
        hooks.update(rest)
    else:
        hooks[key] = hook
    return RemovableHandle(hooks, key)


class ModuleHooks:
    """The hooks of a ``Module`` (a mixin; see ``Module``)."""

    def _hooks(self, name: str) -> dict[int, Any]:
        hooks: dict[int, Any] | None = self.__dict__.get(name)
        if hooks is None:
            hooks = new_hook_dict()
            object.__setattr__(self, name, hooks)
        return hooks

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], *, prepend: bool = False, with_kwargs: bool = False
    ) -> RemovableHandle:
        """Call ``hook(module, args)`` before each ``forward``; a value it returns replaces
        ``args`` (one that is not a tuple is wrapped in one). With ``with_kwargs=True``:
        ``hook(module, args, kwargs)``, returning None or ``(args, kwargs)``. ``prepend``
        runs it before the hooks already registered. Sync or ``async def``."""
        return _add(self._hooks("_forward_pre_hooks"), _Hook(hook, with_kwargs), prepend)

    def register_forward_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """Call ``hook(module, args, output)`` after each ``forward``; a value it returns
        replaces the output. With ``with_kwargs=True``: ``hook(module, args, kwargs,
        output)``. ``always_call=True`` runs it even when ``forward`` raised (with
        ``output=None``; an error it raises then is a warning, the first error goes on).
        Sync or ``async def``."""
        entry = _Hook(hook, with_kwargs, always_call)
        return _add(self._hooks("_forward_hooks"), entry, prepend)

    def register_full_backward_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Call ``hook(module, grad_output)`` when the gradients of a call's outputs are
        known; a tuple it returns replaces ``grad_output``. Sync or ``async def``."""
        return _add(self._hooks("_backward_pre_hooks"), _Hook(hook), prepend)

    def register_full_backward_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> RemovableHandle:
        """Call ``hook(module, grad_input, grad_output)`` when the gradients of a call's
        inputs are known, as PyTorch's: ``grad_input`` has one entry per positional
        argument (None for one that is not a Variable, or that got no gradient),
        ``grad_output`` one per output (a Variable or a tuple of them). A tuple it returns
        replaces ``grad_input``. When no input requires grad, it runs when the outputs'
        gradients are known, with None for every input, and must return None. Sync or
        ``async def``."""
        return _add(self._hooks("_backward_hooks"), _Hook(hook), prepend)

    def _has_hooks(self) -> bool:
        d = self.__dict__
        return bool(
            d.get("_forward_pre_hooks")
            or d.get("_forward_hooks")
            or d.get("_backward_hooks")
            or d.get("_backward_pre_hooks")
        )

    async def _call_with_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``await module(...)`` with hooks: PyTorch's ``nn.Module._call_impl``, awaited."""
        d = self.__dict__
        args, kwargs = await self._run_pre_hooks(args, kwargs)
        backward_hooks = list((d.get("_backward_hooks") or {}).values())
        backward_pre_hooks = list((d.get("_backward_pre_hooks") or {}).values())
        bw_hook = None
        if backward_hooks or backward_pre_hooks:
            bw_hook = _BackwardHook(self, backward_hooks, backward_pre_hooks)
            args = bw_hook.setup_inputs(args)
        forward_hooks = dict(d.get("_forward_hooks") or {})
        called: set[int] = set()
        output: Any = None
        try:
            output = await _maybe_await(self.forward(*args, **kwargs))  # type: ignore[attr-defined]
            for key, entry in forward_hooks.items():
                called.add(key)
                result = await _maybe_await(_forward_hook_call(self, entry, args, kwargs, output))
                if result is not None:
                    output = result
            if bw_hook is not None:
                output = bw_hook.setup_outputs(output)
            return output
        except Exception:
            always = [e for key, e in forward_hooks.items() if e.always_call and key not in called]
            await _run_always_call_hooks(self, always, args, kwargs, output)
            raise

    async def _run_pre_hooks(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for entry in list((self.__dict__.get("_forward_pre_hooks") or {}).values()):
            if entry.with_kwargs:
                result = await _maybe_await(entry.fn(self, args, kwargs))
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"forward pre-hook must return None or a tuple of (new_args, "
                            f"new_kwargs), but got {result!r:.80}."
                        )
                    args, kwargs = result
            else:
                result = await _maybe_await(entry.fn(self, args))
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        return args, kwargs


def _forward_hook_call(
    module: Any, entry: _Hook, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    if entry.with_kwargs:
        return entry.fn(module, args, kwargs, output)
    return entry.fn(module, args, output)


async def _run_always_call_hooks(
    module: Any, hooks: list[_Hook], args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """The ``always_call`` forward hooks that did not run, after ``forward`` (or a hook)
    raised: an error one of them raises is a warning, the first error goes on."""
    for entry in hooks:
        try:
            result = await _maybe_await(_forward_hook_call(module, entry, args, kwargs, output))
        except Exception as exc:
            warnings.warn(
                f"module forward hook with ``always_call=True`` raised an exception that was "
                f"silenced as another error was raised in forward: {exc}",
                stacklevel=3,
            )
            continue
        if result is not None:
            output = result
