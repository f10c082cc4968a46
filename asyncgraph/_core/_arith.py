"""``a + b`` on Variables: numbers add, texts concatenate, both differentiably."""

from __future__ import annotations

import copy
from typing import Any

from ._function import Function
from ._variable import Variable

__all__ = ["Add"]


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return type(value).__module__ == "numpy" and getattr(value.dtype, "kind", "") in "iuf"


def _describe(value: Any) -> str:
    data = value.data if isinstance(value, Variable) else value
    where = f" (role {value.role!r})" if isinstance(value, Variable) and value.role else ""
    return f"{type(data).__name__} {data!r:.40}{where}"


def _shape(value: Any) -> list[int] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else [int(n) for n in shape]


def _unbroadcast(grad: Any, shape: list[int] | None) -> Any:
    """``grad`` summed over the axes numpy broadcast an input of ``shape`` along."""
    grad_shape = getattr(grad, "shape", None)
    if grad_shape is None or (shape is not None and list(grad_shape) == shape):
        return grad
    if shape is None:  # a Python number met an array
        return grad.sum().item()
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


class Add(Function):
    """``a + b`` (and ``a + "text"``, ``1 + a``) when one side is a Variable.

    Numbers (int, float, numpy arrays) add: each side's gradient is the
    incoming gradient (summed over broadcast axes for arrays). Texts
    concatenate with no separator: each side receives the feedback on the
    concatenation unchanged (a Variable added to itself receives it once, as
    with ``asyncgraph.text.concat``). Other data, or text with numbers, raises
    ``TypeError``. The ctx holds plain data, so a subclass may set
    ``dispatch = "remote"``.
    """

    @staticmethod
    def forward(ctx: Any, a: Any, b: Any) -> Variable:
        da = a.data if isinstance(a, Variable) else a
        db = b.data if isinstance(b, Variable) else b
        roles = [v.role for v in (a, b) if isinstance(v, Variable) and v.role]
        if isinstance(da, str) and isinstance(db, str):
            ctx.text = True
            role = f"concatenation of {' and '.join(roles)}" if roles else "concatenation of texts"
        elif _is_number(da) and _is_number(db):
            ctx.text = False
            role = f"sum of {' and '.join(roles)}" if roles else ""
        else:
            raise TypeError(
                f"a + b on Variables concatenates two texts or adds two numbers; got "
                f"{_describe(a)} + {_describe(b)}. Convert one side (str(...), float(...)), "
                f"or use asyncgraph.text.concat or a Function of your own"
            )
        ctx.same = a is b
        ctx.shapes = [_shape(da), _shape(db)]
        return Variable(da + db, role=role)

    @staticmethod
    def backward(ctx: Any, grad: Variable | None) -> tuple[Variable | None, Variable | None]:
        need_a, need_b = ctx.needs_input_grad
        if grad is None:
            return None, None
        if ctx.text:
            # Feedback on the concatenation concerns each part; a part used twice gets it once.
            ga = Variable(copy.copy(grad.data), role=grad.role) if need_a else None
            gb = Variable(copy.copy(grad.data), role=grad.role) if need_b and not ctx.same else None
            return ga, gb
        shape_a, shape_b = ctx.shapes
        out: list[Variable | None] = []
        for need, shape in ((need_a, shape_a), (need_b, shape_b)):
            if not need:
                out.append(None)
                continue
            reduced = _unbroadcast(grad.data, shape)
            out.append(grad if reduced is grad.data else Variable(reduced, role=grad.role))
        return out[0], out[1]
