"""``SGD``: stochastic gradient descent for numeric parameters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncgraph import Variable
from asyncgraph.optim._optimizer import Closure, Optimizer, ParamGroup, Params

__all__ = ["SGD"]


def _is_numeric(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return type(value).__module__ == "numpy" and getattr(value.dtype, "kind", "") in "iuf"


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SGD: {name} must be a number, got {value!r}")
    return float(value)


class SGD(Optimizer):
    """Stochastic gradient descent on numeric parameters (int, float, numpy arrays).

    The update of ``torch.optim.SGD``: with ``g = grad + weight_decay * p``
    (``-grad`` when ``maximize``), and with ``momentum`` a buffer
    ``b = momentum * b + (1 - dampening) * g`` (``b = g`` on the first step) and
    ``g = g + momentum * b`` (``nesterov``) or ``g = b``; then
    ``p.data = p.data - lr * g`` (a new value; arrays are not modified in
    place). Parameters without a gradient are skipped. The momentum buffer is
    ``state[p]["momentum_buffer"]``; ``state_dict()`` stores it as a number or a
    nested list. Raises ``TypeError`` for a text gradient (use ``TGD``).

    Example::

        opt = SGD([w], lr=0.1, momentum=0.9)
        await loss.backward()
        await opt.step()
        opt.zero_grad()
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        *,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params,
            {
                "lr": lr,
                "momentum": momentum,
                "dampening": dampening,
                "weight_decay": weight_decay,
                "nesterov": nesterov,
                "maximize": maximize,
            },
        )

    def _check_group(self, group: ParamGroup) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            if name in group and _number(name, group[name]) < 0:
                raise ValueError(f"SGD: {name} must be >= 0, got {group[name]!r}")
        if group.get("nesterov") and (
            group.get("momentum", 0) <= 0 or group.get("dampening", 0) != 0
        ):
            raise ValueError("SGD: nesterov momentum requires momentum > 0 and dampening == 0")

    async def step(self, closure: Closure | None = None) -> Any:
        """Apply one update to every parameter that has a gradient; returns the closure's loss."""
        loss = await self._run_closure(closure)
        self._warn_no_feedback(self.params)
        for group in self.param_groups:
            lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                if not _is_numeric(grad) or not _is_numeric(p.data):
                    raise TypeError(
                        f"SGD updates numeric parameters; parameter {p.role!r} holds "
                        f"{type(p.data).__name__} with a {type(grad).__name__} gradient "
                        f"({grad!r:.60}). Use TGD for text."
                    )
                if group["maximize"]:
                    grad = -grad
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * p.data
                if momentum:
                    state = self.state.setdefault(p, {})
                    buf = state.get("momentum_buffer")
                    buf = grad if buf is None else momentum * buf + (1 - dampening) * grad
                    state["momentum_buffer"] = buf
                    grad = grad + momentum * buf if group["nesterov"] else buf
                p.data = p.data - lr * grad
        return loss

    def _state_to_data(self, param: Variable, state: dict[str, Any]) -> dict[str, Any]:
        data = dict(state)
        buf = data.get("momentum_buffer")
        if buf is not None and hasattr(buf, "tolist"):
            data["momentum_buffer"] = buf.tolist()
        return data

    def _state_from_data(self, param: Variable, data: Mapping[str, Any]) -> dict[str, Any]:
        state = dict(data)
        buf = state.get("momentum_buffer")
        if buf is not None and type(param.data).__module__ == "numpy":
            import numpy

            state["momentum_buffer"] = numpy.asarray(
                buf, dtype=numpy.result_type(param.data, float)
            )
        return state
