from __future__ import annotations

import json

import numpy as np
import pytest

from asyncgraph import Function, Parameter, Variable
from asyncgraph.optim import SGD, Optimizer

pytestmark = pytest.mark.anyio


class Square(Function):
    @staticmethod
    def forward(ctx: object, x: Variable) -> Variable:
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        return Variable(x.data * x.data)

    @staticmethod
    def backward(ctx: object, grad: Variable) -> Variable:
        (x,) = ctx.saved_variables  # type: ignore[attr-defined]
        return Variable(2 * x.data * grad.data)


async def test_sgd_descends_a_square() -> None:
    w = Parameter(3.0, role="weight")
    opt = SGD([w], lr=0.25)
    for _ in range(3):
        opt.zero_grad()
        await Square.apply(w).backward()
        await opt.step()
    assert w.data == pytest.approx(3.0 * 0.5**3)


async def test_sgd_momentum_weight_decay_nesterov_match_the_reference_update() -> None:
    lr, mu, wd = 0.1, 0.9, 0.01
    w = Parameter(np.array([1.0, -2.0]), role="w")
    opt = SGD([w], lr=lr, momentum=mu, weight_decay=wd, nesterov=True)
    ref, buf = np.array([1.0, -2.0]), None
    for grad in ([0.5, 0.5], [1.0, -1.0], [0.0, 2.0]):
        w.grad = Variable(np.array(grad))
        await opt.step()
        g = np.array(grad) + wd * ref
        buf = g if buf is None else mu * buf + g
        ref = ref - lr * (g + mu * buf)
    np.testing.assert_allclose(w.data, ref)


async def test_sgd_state_dict_is_json_and_restores_numpy_buffers() -> None:
    w = Parameter(np.array([1.0, 2.0]), role="w")
    b = Parameter(0.5, role="b")
    opt = SGD([w, b], lr=0.1, momentum=0.5)
    w.grad, b.grad = Variable(np.array([1.0, 1.0])), Variable(2.0)
    await opt.step()
    saved = opt.state_dict()
    assert json.loads(json.dumps(saved)) == saved
    assert saved["state"] == {"0": {"momentum_buffer": [1.0, 1.0]}, "1": {"momentum_buffer": 2.0}}
    fresh = SGD([w, b], lr=0.1, momentum=0.5)
    fresh.load_state_dict(saved)
    assert isinstance(fresh.state[w]["momentum_buffer"], np.ndarray)
    w.grad, b.grad = Variable(np.array([1.0, 1.0])), Variable(2.0)
    before_w, before_b = w.data.copy(), b.data
    await fresh.step()
    np.testing.assert_allclose(w.data, before_w - 0.1 * 1.5)
    assert b.data == pytest.approx(before_b - 0.1 * 3.0)


async def test_sgd_rejects_text_gradients() -> None:
    p = Parameter(1.0, role="weight")
    p.grad = Variable("bigger")
    with pytest.raises(TypeError, match="Use TGD"):
        await SGD([p], lr=0.1).step()


def test_param_groups_zero_grad_and_misuse() -> None:
    a, b = Parameter(1.0, role="a"), Parameter(2.0, role="b")
    opt = SGD([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    a.grad, b.grad = Variable(1.0), Variable(1.0)
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    with pytest.raises(ValueError, match="more than once"):
        SGD([a, a])
    with pytest.raises(ValueError, match="empty"):
        SGD([])
    with pytest.raises(ValueError, match="non-leaf"):
        SGD([Square.apply(a)])
    with pytest.raises(TypeError, match="wrap it in a list"):
        SGD(a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parameter group"):
        SGD([a]).load_state_dict({"state": {}, "param_groups": []})


async def test_base_optimizer_step_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        await Optimizer([Parameter(1.0)], {}).step()
