"""GradManager (MegEngine semantics): attach, callbacks, record/release, groups."""

from __future__ import annotations

import gc

import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Function, GradManager, GradManagerGroup, Parameter, Variable

from ._ops import Add, Mul


def test_attach_returns_self_and_lists_variables_in_attach_order() -> None:
    a = Parameter(1.0, role="a")
    b = Variable(2.0, role="b")
    gm = GradManager()
    assert gm.attach([a, b]) is gm
    assert b.requires_grad  # attaching a leaf makes it require grad
    assert gm.attached_variables() == [a, b]
    gm.attach(a)  # attaching again does not duplicate
    assert gm.attached_variables() == [a, b]


def test_attach_holds_weak_references() -> None:
    keep = Parameter(1.0)
    gm = GradManager().attach([keep, Parameter(2.0)])  # the second one dies at once
    gc.collect()
    assert gm.attached_variables() == [keep]
    dropped = Parameter(3.0)
    gm.attach(dropped)
    assert len(gm.attached_variables()) == 2
    del dropped
    gc.collect()
    assert gm.attached_variables() == [keep]


def test_attach_validates_variables_and_callbacks() -> None:
    with pytest.raises(TypeError, match="Variable"):
        GradManager().attach([1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="callables"):
        GradManager().attach(Parameter(1.0), callbacks=["nope"])  # type: ignore[list-item]


def test_record_release_and_context_managers() -> None:
    gm = GradManager()
    assert not gm.is_recording
    gm.record()
    assert gm.is_recording
    gm.release()
    assert not gm.is_recording
    with gm as entered:
        assert entered is gm and gm.is_recording
    assert not gm.is_recording


@pytest.mark.anyio
async def test_async_with_records_and_releases() -> None:
    gm = GradManager()
    async with gm as entered:
        assert entered is gm and gm.is_recording
    assert not gm.is_recording


@pytest.mark.anyio
async def test_backward_without_recording_raises_no_computation_history() -> None:
    w = Parameter(2.0)
    gm = GradManager().attach(w)
    y = Mul.apply(w, w)
    with pytest.raises(RuntimeError, match="no computation history"):
        await gm.backward(y)
    assert w.grad is None


@pytest.mark.anyio
async def test_backward_accumulates_only_into_attached_variables_and_releases() -> None:
    w = Parameter(3.0, role="w")
    other = Parameter(5.0, role="other")
    gm = GradManager().attach(w)
    with gm:
        y = Mul.apply(w, other)
        await gm.backward(y)
        assert not gm.is_recording  # backward releases
    assert w.grad is not None and w.grad.data == 5.0
    assert other.grad is None
    with pytest.raises(RuntimeError, match="no computation history"):
        await gm.backward(y)


@pytest.mark.anyio
async def test_backward_accumulates_across_recordings_and_takes_dy() -> None:
    w = Parameter(3.0)
    gm = GradManager().attach(w)
    for _ in range(2):
        async with gm:
            await gm.backward(Mul.apply(w, w), dy=0.5)
    assert w.grad is not None and w.grad.data == 6.0


@pytest.mark.anyio
async def test_backward_with_several_outputs() -> None:
    w = Parameter(2.0)
    gm = GradManager().attach(w)
    with gm:
        await gm.backward([Mul.apply(w, w), Add.apply(w, w)], dy=[1.0, 10.0])
    assert w.grad is not None and w.grad.data == 4.0 + 20.0


@pytest.mark.anyio
async def test_backward_without_y_only_releases() -> None:
    gm = GradManager().attach(Parameter(1.0))
    gm.record()
    await gm.backward()
    assert not gm.is_recording


@pytest.mark.anyio
async def test_callbacks_chain_in_order_sync_and_async() -> None:
    w = Parameter(1.0, role="w")
    calls: list[tuple[str, str, float]] = []

    def scale(var: Variable, g: Variable) -> Variable:
        calls.append(("scale", var.role, g.data))
        return Variable(g.data * 10)

    async def shift(var: Variable, g: Variable) -> Variable:
        await anyio.lowlevel.checkpoint()
        calls.append(("shift", var.role, g.data))
        return Variable(g.data + 1)

    def observe(var: Variable, g: Variable) -> None:
        calls.append(("observe", var.role, g.data))

    gm = GradManager().attach(w, callbacks=[scale, shift])
    gm.attach(w, callbacks=observe)  # attaching again adds callbacks
    with gm:
        await gm.backward(Mul.apply(w, Variable(2.0)))
    assert calls == [("scale", "w", 2.0), ("shift", "w", 20.0), ("observe", "w", 21.0)]
    assert w.grad is not None and w.grad.data == 21.0


@pytest.mark.anyio
async def test_failing_callback_leaves_every_grad_untouched() -> None:
    a = Parameter(1.0)
    b = Parameter(1.0)

    def broken(var: Variable, g: Variable) -> None:
        raise ValueError("clip failed")

    gm = GradManager().attach(a).attach(b, callbacks=broken)
    with gm, pytest.raises(BackwardError, match="clip failed") as info:
        await gm.backward(Mul.apply(a, b))
    assert "GradManager callbacks [" in str(info.value) and "broken" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert a.grad is None and b.grad is None
    assert not gm.is_recording


@pytest.mark.anyio
async def test_attached_non_leaf_gets_its_gradient() -> None:
    w = Parameter(2.0)
    h = Mul.apply(w, w)
    gm = GradManager().attach(h)
    with gm:
        await gm.backward(Mul.apply(h, Variable(3.0)))
    assert h.grad is not None and h.grad.data == 3.0
    assert w.grad is None


@pytest.mark.anyio
async def test_a_retained_variable_gets_its_gradient_once_attached_or_not() -> None:
    # retain_grad() fills .grad in a GradManager pass too (PyTorch's retains_grad hooks
    # run in every pass); attached as well, it is staged once, not added twice.
    w = Parameter(2.0)
    gm = GradManager().attach(w)
    with gm:
        h = Mul.apply(w, w)
        h.retain_grad()
        k = Mul.apply(h, Variable(3.0))
        k.retain_grad()
        gm.attach(k)
        await gm.backward(Mul.apply(k, Variable(5.0)))
    assert k.grad is not None and k.grad.data == 5.0
    assert h.grad is not None and h.grad.data == 15.0
    assert w.grad is not None and w.grad.data == 60.0


@pytest.mark.anyio
async def test_grad_managers_grouped_with_or_record_together() -> None:
    a = Parameter(2.0, role="a")
    b = Parameter(3.0, role="b")
    c = Parameter(4.0, role="c")
    gm1 = GradManager().attach(a)
    gm2 = GradManager().attach(b)
    gm3 = GradManager().attach(c)
    group = gm1 | gm2
    assert isinstance(group, GradManagerGroup)
    assert group.managers == (gm1, gm2)
    bigger = group | gm3
    assert bigger.managers == (gm1, gm2, gm3)
    assert (group | gm1).managers == (gm1, gm2)  # no duplicates
    with group:
        assert gm1.is_recording and gm2.is_recording and not gm3.is_recording
        y = Mul.apply(Mul.apply(a, b), c)
        await gm1.backward(y)
        assert not gm1.is_recording and gm2.is_recording
        await gm2.backward(Mul.apply(a, b))
    assert not gm1.is_recording and not gm2.is_recording
    assert a.grad is not None and a.grad.data == 12.0
    assert b.grad is not None and b.grad.data == 2.0
    assert c.grad is None
    async with bigger:
        assert gm1.is_recording and gm2.is_recording and gm3.is_recording
    assert not (gm1.is_recording or gm2.is_recording or gm3.is_recording)


@pytest.mark.anyio
async def test_grouped_managers_backward_through_the_same_graph_in_turn() -> None:
    a = Parameter(2.0, role="a")
    b = Parameter(3.0, role="b")
    gm1 = GradManager().attach(a)
    gm2 = GradManager().attach(b)
    with gm1 | gm2:
        y = Mul.apply(a, b)
        await gm1.backward(y)  # gm2 still records: the graph is kept for it
        await gm2.backward(y)
    assert a.grad is not None and a.grad.data == 3.0
    assert b.grad is not None and b.grad.data == 2.0


def test_record_twice_raises() -> None:
    gm = GradManager()
    gm.record()
    with pytest.raises(RuntimeError, match="already recording"):
        gm.record()
    gm.release()


# --- Recording gates what counts; callbacks run inside the pass (MegEngine's seed) --------


@pytest.mark.anyio
async def test_a_forward_before_record_contributes_no_gradient() -> None:
    w = Parameter(3.0)
    gm = GradManager().attach(w)
    before = Mul.apply(w, Variable(10.0))  # before record(): ignored by gm.backward
    with gm:
        after = Mul.apply(w, Variable(2.0))
        await gm.backward(Add.apply(before, after))
    assert w.grad is not None and w.grad.data == 2.0  # only the recorded use
    # Without a GradManager, the same graph gives both uses (the gate is gm's alone).
    w.grad = None
    await Add.apply(Mul.apply(w, Variable(10.0)), Mul.apply(w, Variable(2.0))).backward()
    assert w.grad.data == 12.0


@pytest.mark.anyio
async def test_an_output_computed_entirely_before_record_gives_nothing() -> None:
    w = Parameter(3.0)
    gm = GradManager().attach(w)
    y = Mul.apply(w, w)
    with gm:
        await gm.backward(y)
    assert w.grad is None


class Gate(Function):
    """Backward waits for an event: lets a test observe the pass while it runs."""

    gate: anyio.Event

    @staticmethod
    def forward(ctx: object, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: object, g: Variable) -> Variable:
        await Gate.gate.wait()
        return g


@pytest.mark.anyio
async def test_callbacks_run_during_the_pass_as_each_gradient_is_final() -> None:
    fast = Parameter(1.0, role="fast")
    slow = Parameter(1.0, role="slow")
    Gate.gate = anyio.Event()
    log: list[str] = []

    def first(var: Variable, g: Variable) -> Variable:
        log.append(f"first {var.role} {g.data}")
        return Variable(g.data * 10)

    async def second(var: Variable, g: Variable) -> None:
        log.append(f"second {var.role} {g.data}")
        if var.role == "fast":
            Gate.gate.set()  # the slow branch is still waiting: we run inside the pass
        return None

    gm = GradManager().attach([fast, slow], callbacks=[first, second])
    with gm:
        y = Add.apply(Mul.apply(fast, Variable(2.0)), Gate.apply(Mul.apply(slow, Variable(3.0))))
        await gm.backward(y)
    assert log == ["first fast 2.0", "second fast 20.0", "first slow 3.0", "second slow 30.0"]
    assert fast.grad.data == 20.0 and slow.grad.data == 30.0  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_a_failed_pass_commits_nothing_even_after_callbacks_ran() -> None:
    ok = Parameter(1.0, role="ok")
    doomed = Parameter(1.0, role="doomed")
    ran: list[str] = []

    class Boom(Function):
        @staticmethod
        def forward(ctx: object, x: Variable) -> Variable:
            return Variable(x.data)

        @staticmethod
        async def backward(ctx: object, g: Variable) -> Variable:
            await anyio.sleep(0.01)
            raise RuntimeError("worker lost")

    gm = GradManager().attach([ok, doomed], callbacks=lambda v, g: ran.append(v.role))
    with gm, pytest.raises(BackwardError, match="worker lost"):
        await gm.backward(Add.apply(Mul.apply(ok, Variable(2.0)), Boom.apply(doomed)))
    assert ran == ["ok"]  # the callback ran inside the pass...
    assert ok.grad is None and doomed.grad is None  # ...but nothing was committed


def test_attached_variables_are_held_weakly() -> None:
    gm = GradManager()
    p = Parameter(1.0)
    gm.attach(p)
    assert gm.attached_variables() == [p]
    del p
    gc.collect()
    assert gm.attached_variables() == []


# -- one commit path: GradManager.backward writes .grad as backward() does ---------------


class _Fan(Function):
    """y = sum of the inputs; backward hands every input the same gradient object."""

    @staticmethod
    def forward(ctx, *xs):  # type: ignore[no-untyped-def]
        ctx.n = len(xs)
        return sum(x.data for x in xs)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return (g,) * ctx.n


class _Double(Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return 2 * x.data

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return Variable(2 * g.data)


@pytest.mark.anyio
async def test_gm_backward_gives_each_leaf_its_own_grad_and_never_writes_dy() -> None:
    """The issue's reproduction: attached leaves sharing one .grad (and the caller's dy)
    were all changed by the next in-place accumulation."""
    from asyncgraph import backward

    a, b = Parameter(1.0), Parameter(2.0)
    gm = GradManager().attach([a, b])
    dy = Variable(1.0)
    with gm:
        await gm.backward(_Fan.apply(a, b), dy)
    assert a.grad is not b.grad and a.grad is not dy and b.grad is not dy
    await backward(_Double.apply(a))  # only a gets +2
    assert (a.grad.data, b.grad.data, dy.data) == (3.0, 1.0, 1.0)


@pytest.mark.anyio
async def test_backward_with_create_graph_gives_each_leaf_its_own_grad() -> None:
    """Under create_graph .grad kept the caller's gradient itself: a later in-place
    accumulation changed the caller's dy and every leaf sharing it (a reviewer's repro)."""
    from asyncgraph import backward

    a, b = Parameter(1.0), Parameter(2.0)
    dy = Variable(1.0)
    await backward(_Fan.apply(a, b), dy, create_graph=True)
    assert a.grad is not b.grad and dy not in (a.grad, b.grad)
    await backward(_Double.apply(a))
    assert (a.grad.data, b.grad.data, dy.data) == (3.0, 1.0, 1.0)


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(12))
async def test_random_mixes_of_backward_grad_and_gm_commit_through_one_path(seed: int) -> None:
    """Random mixes of backward, grad and GradManager.backward (with and without an output
    gradient), fanning out to several leaves, accumulating later: no two leaves ever
    share a .grad, the caller's gradient is never written, and every value equals a
    sequential reference computed by hand."""
    import random

    from asyncgraph import backward, grad

    rng = random.Random(seed)
    leaves = [Parameter(float(i + 1), role=f"x{i}") for i in range(5)]
    expected: dict[int, float] = {}
    for _ in range(20):
        chosen = rng.sample(range(len(leaves)), rng.randint(1, len(leaves)))
        doubled = {i for i in chosen if rng.random() < 0.3}
        # y = sum over chosen of (2 * x_i if doubled else x_i): a fan-out of one object
        terms = [_Double.apply(leaves[i]) if i in doubled else leaves[i] for i in chosen]
        kind = rng.choice(["backward", "grad", "gm", "gm"])
        dy_value = rng.choice([None, 1.0, 0.5, 3.0])
        dy = None if dy_value is None else Variable(dy_value)
        g = 1.0 if dy_value is None else dy_value
        if kind == "grad":
            y = _Fan.apply(*terms)
            got = await grad(y, [leaves[i] for i in chosen], dy)
            for i, gi in zip(chosen, got, strict=True):
                assert gi is not None and gi.data == g * (2 if i in doubled else 1)
        elif kind == "backward":
            # create_graph keeps history; a .grad is still its own object (PyTorch clones)
            await backward(_Fan.apply(*terms), dy, create_graph=rng.random() < 0.3)
            for i in chosen:
                expected[i] = expected.get(i, 0.0) + g * (2 if i in doubled else 1)
        else:
            attached = rng.sample(range(len(leaves)), rng.randint(1, len(leaves)))
            gm = GradManager().attach([leaves[i] for i in attached])
            with gm:
                y = _Fan.apply(
                    *[_Double.apply(leaves[i]) if i in doubled else leaves[i] for i in chosen]
                )
                await gm.backward(y, dy)
            for i in set(attached) & set(chosen):
                expected[i] = expected.get(i, 0.0) + g * (2 if i in doubled else 1)
        if dy is not None:
            assert dy.data == dy_value, f"{kind} wrote the caller's gradient"
        grads = [x.grad for x in leaves if x.grad is not None]
        assert len({id(gr) for gr in grads}) == len(grads), f"leaves share a .grad after {kind}"
        got_values = {i: x.grad.data for i, x in enumerate(leaves) if x.grad is not None}
        assert got_values == pytest.approx(expected), kind


def test_only_the_engines_commit_writes_a_gradient_into_grad() -> None:
    """One commit path (#33): outside ``Engine.commit`` the library only clears ``.grad``
    (``zero_grad``); a feature that wrote it itself would bypass ``own_grad``."""
    import ast
    from pathlib import Path

    import asyncgraph

    root = Path(asyncgraph.__file__).parent
    writers = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in targets:
                    if not (isinstance(target, ast.Attribute) and target.attr == "grad"):
                        continue
                    value = node.value  # type: ignore[attr-defined]
                    if isinstance(value, ast.Constant) and value.value is None:
                        continue  # clearing
                    writers.append(f"{path.relative_to(root)}:{node.lineno} in {func.name}")
    assert [w for w in writers if not w.startswith("_core/_engine.py")] == []
    assert all(w.endswith(" in commit") for w in writers), writers
