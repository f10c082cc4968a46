"""Module hooks: forward pre-hooks, forward hooks, full backward (pre-)hooks.

Ported from PyTorch's test/nn/test_module_hooks.py (TestModuleHooks), on small numeric
Modules made of the shared test Functions.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Module, Parameter, Variable, no_grad

from ._ops import Add, Mul

pytestmark = pytest.mark.anyio


class Scale(Module):
    """``x * w``: a one-weight Linear."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = Parameter(w, role="w")

    async def forward(self, x: Variable) -> Variable:
        out: Variable = Mul.apply(x, self.w)
        return out


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq1 = Scale(2.0)
        self.seq2 = Scale(3.0)

    async def forward(self, x: Variable) -> Variable:
        out: Variable = await self.seq2(await self.seq1(x))
        return out


class ToyModel(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = Net()
        self.net2 = Net()

    async def forward(self, x: Variable) -> Variable:
        out: Variable = await self.net2(await self.net1(x))
        return out


class KwargModel(Module):
    async def forward(self, x: Variable, bias: Variable | None = None) -> Variable:
        if bias is not None:
            x = Add.apply(x, bias)
        return x

    def internal_forward_hook(
        self, module: Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Variable
    ) -> Variable:
        result: Variable = Add.apply(out, kwargs["bias"])
        return result


def forward_hook(
    fired: list[int], expected: Module, hook_id: int, module: Module, inp: tuple[Any, ...], out: Any
) -> None:
    fired.append(hook_id)
    assert module is expected and len(inp) == 1


def forward_pre_hook(
    fired: list[int], expected: Module, hook_id: int, module: Module, inp: tuple[Any, ...]
) -> None:
    fired.append(hook_id)
    assert module is expected and len(inp) == 1


def full_backward_hook(
    fired: list[int],
    expected: Module,
    hook_id: int,
    module: Module,
    grad_input: tuple[Any, ...],
    grad_output: tuple[Any, ...],
) -> None:
    fired.append(hook_id)
    assert module is expected and len(grad_input) == 1 and len(grad_output) == 1


def full_backward_pre_hook(
    fired: list[int], expected: Module, hook_id: int, module: Module, grad_output: tuple[Any, ...]
) -> None:
    fired.append(hook_id)
    assert module is expected and len(grad_output) == 1


def kwarg_forward_pre_hook(
    fired: list[int],
    expected: Module,
    hook_id: int,
    module: Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    fired.append(hook_id)
    assert module is expected and len(args) == 1
    kwargs["bias"] = Mul.apply(kwargs["bias"], Variable(2.0))
    return args, kwargs


def kwarg_forward_hook(
    fired: list[int],
    expected: Module,
    hook_id: int,
    module: Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Variable,
) -> Any:
    fired.append(hook_id)
    assert module is expected and len(args) == 1
    return Add.apply(out, kwargs["bias"])


def x_input() -> Variable:
    return Variable(1.5, role="x", requires_grad=True)


async def test_forward_hooks() -> None:
    fired: list[int] = []
    model = ToyModel()
    hook = partial(forward_hook, fired, model.net1.seq2)
    model.net1.seq2.register_forward_hook(partial(hook, 0))
    model.net1.seq2.register_forward_hook(partial(hook, 1), prepend=True)
    model.net1.seq2.register_forward_hook(partial(hook, 2))
    model.net1.seq2.register_forward_hook(partial(hook, 3))
    model.net1.seq2.register_forward_hook(partial(hook, 4), prepend=True)
    expected = [4, 1, 0, 2, 3]
    assert fired == []
    out = await model(x_input())
    assert fired == expected
    await out.backward()
    assert fired == expected
    await (await model(x_input())).backward()
    assert fired == expected + expected


async def test_forward_pre_hooks() -> None:
    fired: list[int] = []
    model = ToyModel()
    hook = partial(forward_pre_hook, fired, model.net2.seq1)
    model.net2.seq1.register_forward_pre_hook(partial(hook, 0), prepend=True)
    model.net2.seq1.register_forward_pre_hook(partial(hook, 1))
    model.net2.seq1.register_forward_pre_hook(partial(hook, 2))
    model.net2.seq1.register_forward_pre_hook(partial(hook, 3))
    model.net2.seq1.register_forward_pre_hook(partial(hook, 4), prepend=True)
    expected = [4, 0, 1, 2, 3]
    out = await model(x_input())
    assert fired == expected
    await out.backward()
    assert fired == expected
    await (await model(x_input())).backward()
    assert fired == expected + expected


async def test_full_backward_hooks() -> None:
    fired: list[int] = []
    model = ToyModel()
    hook = partial(full_backward_hook, fired, model.net1)
    model.net1.register_full_backward_hook(partial(hook, 0))
    model.net1.register_full_backward_hook(partial(hook, 1))
    model.net1.register_full_backward_hook(partial(hook, 2))
    model.net1.register_full_backward_hook(partial(hook, 3), prepend=True)
    model.net1.register_full_backward_hook(partial(hook, 4), prepend=True)
    expected = [4, 3, 0, 1, 2]
    out = await model(x_input())
    assert fired == []
    await out.backward()
    assert fired == expected
    await (await model(x_input())).backward()
    assert fired == expected + expected


async def test_full_backward_pre_hooks() -> None:
    fired: list[int] = []
    model = ToyModel()
    hook = partial(full_backward_pre_hook, fired, model.net1)
    model.net1.register_full_backward_pre_hook(partial(hook, 0), prepend=True)
    model.net1.register_full_backward_pre_hook(partial(hook, 1), prepend=True)
    model.net1.register_full_backward_pre_hook(partial(hook, 2))
    model.net1.register_full_backward_pre_hook(partial(hook, 3))
    model.net1.register_full_backward_pre_hook(partial(hook, 4))
    expected = [1, 0, 2, 3, 4]
    out = await model(x_input())
    assert fired == []
    await out.backward()
    assert fired == expected
    await (await model(x_input())).backward()
    assert fired == expected + expected

    # A backward pre hook can change the gradient computed after it.
    a = x_input()
    scale = Scale(2.0)
    scale.register_full_backward_pre_hook(lambda module, grad_output: (Variable(0.0),))
    await (await scale(a)).backward()
    assert a.grad is not None and a.grad.data == 0.0


async def test_mixed_hooks() -> None:
    fired: list[int] = []
    model = ToyModel()
    model.register_forward_pre_hook(partial(forward_pre_hook, fired, model, 0))
    model.register_forward_hook(partial(forward_hook, fired, model, 1))
    model.register_full_backward_pre_hook(partial(full_backward_pre_hook, fired, model, 2))
    model.register_full_backward_hook(partial(full_backward_hook, fired, model, 3))
    out = await model(x_input())
    assert fired == [0, 1]
    await out.backward()
    assert fired == [0, 1, 2, 3]
    await (await model(x_input())).backward()
    assert fired == [0, 1, 2, 3, 0, 1, 2, 3]


async def test_kwarg_hooks() -> None:
    # 1. forward pre hook: bias' = bias * 2, so out = x + 2 * bias
    fired: list[int] = []
    model = KwargModel()
    model.register_forward_pre_hook(
        partial(kwarg_forward_pre_hook, fired, model, 0), with_kwargs=True
    )
    out = await model(Variable(1.0), bias=Variable(1.0))
    assert fired == [0] and out.data == 3.0

    # 2. forward pre and forward hooks: out = x + 4 * bias
    fired = []
    model = KwargModel()
    model.register_forward_hook(partial(kwarg_forward_hook, fired, model, 1), with_kwargs=True)
    model.register_forward_pre_hook(
        partial(kwarg_forward_pre_hook, fired, model, 0), with_kwargs=True
    )
    out = await model(Variable(1.0), bias=Variable(1.0))
    assert fired == [0, 1] and out.data == 5.0

    # 3. a Module's own method as a forward hook: out = x + 2 * bias
    model = KwargModel()
    model.register_forward_hook(model.internal_forward_hook, with_kwargs=True)
    out = await model(Variable(1.0), bias=Variable(1.0))
    assert out.data == 3.0


async def test_remove_kwarg_hooks() -> None:
    fired: list[int] = []
    model = KwargModel()
    forward_handle = model.register_forward_hook(
        partial(kwarg_forward_hook, fired, model, 1), with_kwargs=True
    )
    pre_handle = model.register_forward_pre_hook(
        partial(kwarg_forward_pre_hook, fired, model, 0), with_kwargs=True
    )
    assert (await model(Variable(1.0), bias=Variable(1.0))).data == 5.0
    assert fired == [0, 1]
    forward_handle.remove()
    assert (await model(Variable(1.0), bias=Variable(1.0))).data == 3.0
    assert fired == [0, 1, 0]
    pre_handle.remove()
    assert (await model(Variable(1.0), bias=Variable(1.0))).data == 2.0
    assert fired == [0, 1, 0]


async def test_bw_hook_warning_for_non_variable_or_tuple() -> None:
    counter = {"forward": 0, "backward": 0}

    def fw_pre_hook(module: Module, inputs: Any) -> None:
        counter["forward"] += 1

    def fw_hook(module: Module, inputs: Any, outputs: Any) -> None:
        counter["forward"] += 1

    def bw_hook(module: Module, *grads: Any) -> None:
        counter["backward"] += 1

    class TestModule(Module):
        async def forward(self, inputs: dict[str, Variable]) -> dict[str, Variable]:
            return {"x": Mul.apply(inputs["x"], Variable(2.0))}

    x = x_input()
    model = TestModule()
    model.register_forward_pre_hook(fw_pre_hook)
    model.register_forward_hook(fw_hook)
    model.register_full_backward_pre_hook(bw_hook)
    model.register_full_backward_hook(bw_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = (await model({"x": x}))["x"]
        await y.backward()
    assert counter == {"forward": 2, "backward": 0}
    assert len(caught) == 1
    assert "should be a Variable or a tuple of Variables" in str(caught[0].message)


async def test_full_backward_hook_sees_and_replaces_the_gradients() -> None:
    """grad_input: one per positional argument (None for one that is not a Variable or
    needs no gradient); grad_output: one per output; a tuple returned replaces
    grad_input (PyTorch's BackwardHook)."""

    class Pair(Module):
        async def forward(self, x: Variable, k: float, y: Variable) -> tuple[Variable, Variable]:
            return Mul.apply(x, Variable(k)), Mul.apply(y, Variable(k))

    seen: list[Any] = []

    def hook(module: Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...]) -> Any:
        seen.append(([_data(g) for g in grad_input], [_data(g) for g in grad_output]))
        return (Variable(100.0), None, grad_input[2])

    x, y = x_input(), Variable(2.0)  # y needs no gradient
    pair = Pair()
    pair.register_full_backward_hook(hook)
    a, b = await pair(x, 3.0, y)
    await Add.apply(a, Mul.apply(b, Variable(5.0))).backward()
    # b needs no gradient (nor does y): None for both, no zero invented.
    assert seen == [([3.0, None, None], [1.0, None])]
    assert x.grad is not None and x.grad.data == 100.0

    seen.clear()
    x, y = x_input(), Variable(2.0, requires_grad=True)
    a, b = await pair(x, 3.0, y)
    await Add.apply(a, Mul.apply(b, Variable(5.0))).backward()
    assert seen == [([3.0, None, 15.0], [1.0, 5.0])]
    assert x.grad is not None and x.grad.data == 100.0
    assert y.grad is not None and y.grad.data == 15.0

    # A hook may be async; returning the wrong number of gradients is a clear error.
    async def wrong(module: Module, grad_input: Any, grad_output: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        return (None,)

    pair = Pair()
    pair.register_full_backward_hook(wrong)
    a, b = await pair(x_input(), 3.0, Variable(2.0))
    with pytest.raises(BackwardError, match="invalid number of grad_input, got 1, but expected 3"):
        await a.backward()


async def test_full_backward_hook_when_no_input_requires_grad() -> None:
    seen: list[Any] = []
    scale = Scale(2.0)  # the weight requires grad; the input does not
    scale.register_full_backward_hook(lambda m, gi, go: seen.append((gi, _data(go[0]))))
    out = await scale(Variable(4.0))
    await out.backward()
    assert seen == [((None,), 1.0)]
    assert scale.w.grad is not None and scale.w.grad.data == 4.0

    scale = Scale(2.0)
    scale.register_full_backward_hook(lambda m, gi, go: (Variable(1.0),))
    out = await scale(Variable(4.0))
    with pytest.raises(BackwardError, match="no input requires gradient should always return"):
        await out.backward()


async def test_module_hooks_under_no_grad_and_with_an_unused_input() -> None:
    fired: list[str] = []
    scale = Scale(2.0)
    scale.register_forward_hook(lambda m, args, out: fired.append("forward"))
    scale.register_full_backward_hook(lambda m, gi, go: fired.append("backward"))
    with no_grad():
        out = await scale(x_input())
    assert out.grad_fn is None and fired == ["forward"]

    class First(Module):
        async def forward(self, x: Variable, unused: Variable) -> Variable:
            return Mul.apply(x, Variable(2.0))

    seen: list[Any] = []
    first = First()
    first.register_full_backward_hook(lambda m, gi, go: seen.append([_data(g) for g in gi]))
    x, unused = x_input(), x_input()
    await (await first(x, unused)).backward()
    # None for the unused input (no zero invented), and its .grad stays None.
    assert seen == [[2.0, None]] and unused.grad is None


async def test_always_call_forward_hooks_run_when_forward_raises() -> None:
    calls: list[Any] = []

    class Fails(Module):
        async def forward(self, x: Variable) -> Variable:
            raise ValueError("forward failed")

    fails = Fails()
    fails.register_forward_hook(lambda m, args, out: calls.append(("plain", out)))
    fails.register_forward_hook(
        lambda m, args, out: calls.append(("always", out)), always_call=True
    )
    with pytest.raises(ValueError, match="forward failed"):
        await fails(x_input())
    assert calls == [("always", None)]

    def raises(module: Module, args: Any, out: Any) -> None:
        raise RuntimeError("hook failed")

    fails = Fails()
    fails.register_forward_hook(raises, always_call=True)
    with (
        pytest.warns(UserWarning, match="silenced as another error was raised in forward"),
        pytest.raises(ValueError, match="forward failed"),
    ):
        await fails(x_input())


async def test_hooks_are_removed_by_their_handles_and_bad_returns_are_errors() -> None:
    scale = Scale(2.0)
    fired: list[str] = []
    handles = [
        scale.register_forward_pre_hook(lambda m, args: fired.append("pre")),
        scale.register_forward_hook(lambda m, args, out: fired.append("post")),
        scale.register_full_backward_pre_hook(lambda m, go: fired.append("bw-pre")),
        scale.register_full_backward_hook(lambda m, gi, go: fired.append("bw")),
    ]
    await (await scale(x_input())).backward()
    assert fired == ["pre", "post", "bw-pre", "bw"]
    for handle in handles:
        handle.remove()
    await (await scale(x_input())).backward()
    assert fired == ["pre", "post", "bw-pre", "bw"]

    scale.register_forward_pre_hook(lambda m, a, k: "not a pair", with_kwargs=True)
    with pytest.raises(RuntimeError, match=r"must return None or a tuple of \(new_args"):
        await scale(x_input())
    with pytest.raises(TypeError, match="must be callable"):
        scale.register_forward_hook("not callable")  # type: ignore[arg-type]

    # A pre hook returning one value (not a tuple) replaces the arguments with it.
    scale = Scale(2.0)
    scale.register_forward_pre_hook(lambda m, args: Variable(10.0))
    assert (await scale(x_input())).data == 20.0


def _data(g: Any) -> Any:
    return None if g is None else g.data
