"""Remote backwards give the local executor's gradients, byte for byte; errors are clear."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import agdist_functions as F
import anyio
import numpy as np
import pytest

from asyncgraph import (
    BackwardError,
    Function,
    GraphError,
    LocalExecutor,
    Parameter,
    RemoteError,
    Variable,
    backward,
    grad,
    no_grad,
    use_executor,
)
from asyncgraph.distributed import open_redis_executor

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Add(Function):
    """A cheap local node between remote ones."""

    @staticmethod
    def forward(ctx: Any, a: Variable, b: Variable) -> Variable:
        return Variable(a.data + b.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Variable, Variable]:
        return g, g


def canonical(value: Any) -> Any:
    """An exact, comparable form of gradient data (type, dtype and bytes for arrays)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("npscalar", value.dtype.str, value.tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [canonical(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, canonical(v)) for k, v in value.items()])
    return (type(value).__name__, repr(value))


def grads_of(leaves: list[Parameter]) -> list[Any]:
    return [None if p.grad is None else (p.grad.role, canonical(p.grad.data)) for p in leaves]


Graph = Callable[[], tuple[list[Parameter], list[Variable]]]


def text_and_numbers() -> tuple[list[Parameter], list[Variable]]:
    x = Parameter(3.0, role="x")
    t = Parameter("hello", role="t")
    y = F.Scale.apply(x, 2.5)
    a, b = F.Split.apply(y)
    z = Add.apply(F.Scale.apply(a, 0.1), b)
    s1, s2 = F.Shout.apply(t), F.Shout.apply(t)
    return [x, t], [z, s1, s2]


def fan_in() -> tuple[list[Parameter], list[Variable]]:
    leaves = [Parameter(float(i) + 0.1, role=f"p{i}") for i in range(8)]
    outs = []
    for i, p in enumerate(leaves):
        for j in range(3):
            outs.append(F.Scale.apply(F.Noop.apply(p), 1.0 / (i + j + 1)))
    return leaves, [Add.apply(outs[i], outs[i + 1]) for i in range(0, len(outs) - 1, 2)]


def arrays() -> tuple[list[Parameter], list[Variable]]:
    x = Parameter(np.linspace(0.0, 1.0, 5, dtype=np.float32), role="x")
    y = F.Scale.apply(x, np.float32(0.3))
    z = F.Scale.apply(F.Noop.apply(x), np.float32(1.7))
    return [x], [Add.apply(y, z)]


def odd_data() -> tuple[list[Parameter], list[Variable]]:
    """0-d and big-endian arrays as gradients; an int-keyed dict on ctx (Variable data
    dicts need str keys, ctx attributes may use int keys)."""
    zero_d = Parameter(np.array(3.0), role="zero-d")
    big = Parameter(np.arange(4, dtype=">f8"), role="big-endian")
    w = Parameter(np.arange(3, dtype=">i4"), role="w")
    return [zero_d, big, w], [
        F.Noop.apply(zero_d),
        F.Noop.apply(big),
        F.Table.apply(w, {1: 3, 2: 5}),
    ]


def seed(outs: list[Variable]) -> tuple[Any, ...]:
    # Same shape and dtype as the output, byte order included.
    return tuple(np.ones_like(o.data) if isinstance(o.data, np.ndarray) else None for o in outs)


def test_odd_data_graph_is_really_odd() -> None:
    _, outs = odd_data()
    grads = seed(outs)
    assert grads[0].shape == () and grads[1].dtype.str == ">f8"
    assert outs[2].grad_fn is not None and outs[2].grad_fn.ctx.table == {1: 3, 2: 5}


@pytest.mark.parametrize("graph", [text_and_numbers, fan_in, arrays, odd_data])
async def test_grads_equal_local_executor_byte_for_byte(
    redis_server_url: str, shared_fleet: str, graph: Graph
) -> None:
    leaves, outs = graph()
    await backward(outs, seed(outs), executor=LocalExecutor())
    expected = grads_of(leaves)

    leaves, outs = graph()
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward(outs, seed(outs), executor=ex)
        assert ex.stats.submitted > 0
        assert ex.stats.duplicate_replies == 0
    assert grads_of(leaves) == expected


@pytest.mark.parametrize("ready", [1, 10, 200])
async def test_ready_nodes_of_a_backward_go_in_one_round_trip(
    redis_server_url: str, shared_fleet: str, ready: int
) -> None:
    leaves = [Parameter(float(i)) for i in range(ready)]
    outs = [F.Noop.apply(p) for p in leaves]
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward(outs, executor=ex)
        assert (ex.stats.submitted, ex.stats.flushes) == (ready, 1)
    assert [p.grad.data for p in leaves] == [1.0] * ready  # type: ignore[union-attr]


async def test_parallel_chains_send_each_level_together(
    redis_server_url: str, shared_fleet: str
) -> None:
    """Replies resolved together wake nodes whose next nodes are sent together too."""
    chains = 50
    leaves = [Parameter(float(i)) for i in range(chains)]
    outs = [F.Noop.apply(F.Noop.apply(F.Noop.apply(p))) for p in leaves]
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward(outs, executor=ex)
        assert ex.stats.submitted == 3 * chains
        # About one trip per batch of replies read (the worker answers in batches, so
        # the levels interleave: 10 to 14 here). One per node (150) would be the bug.
        assert ex.stats.flushes <= chains // 2
    assert [p.grad.data for p in leaves] == [1.0] * chains  # type: ignore[union-attr]


async def test_concurrent_remote_forwards_share_round_trips(
    redis_server_url: str, shared_fleet: str
) -> None:
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        results: list[float] = []

        async def forward(i: int) -> None:
            y = await ex.apply(F.Double, Parameter(float(i)))
            results.append(y.data)

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(forward, i)
        assert sorted(results) == [2.0 * i for i in range(40)]
        assert ex.stats.flushes <= 4  # the first at once, the others together


async def test_grad_and_use_executor_run_remotely(redis_server_url: str, shared_fleet: str) -> None:
    x = Parameter(2.0, role="x")
    y = F.Scale.apply(F.Scale.apply(x, 3.0), 5.0)
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with use_executor(ex):
            (g,) = await grad(y, x)
        assert ex.stats.completed == 2
    assert g is not None and g.data == 15.0
    assert x.grad is None


async def test_local_nodes_never_cross_the_network(
    redis_server_url: str, shared_fleet: str
) -> None:
    a, b = Parameter(1.0), Parameter(2.0)
    z = Add.apply(Add.apply(a, b), F.Noop.apply(b))
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward(z, executor=ex)
        assert ex.stats.submitted == 1  # only Noop
    assert (a.grad.data, b.grad.data) == (1.0, 2.0)  # type: ignore[union-attr]


async def test_remote_forward_with_apply(redis_server_url: str, shared_fleet: str) -> None:
    x = Parameter(4.0, role="x")
    w = Parameter(np.array(2.0), role="w")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        y = await ex.apply(F.Double, x)
        assert (y.data, y.role, y.grad_fn.name) == (8.0, "doubled", "Double")
        assert y.grad_fn.ctx.factor == 2
        await backward(y, executor=ex)
        # An int-keyed dict argument and a 0-d array travel to the forward and back.
        z = await ex.apply(F.Table, w, {1: 3.0})
        assert z.data.shape == () and z.grad_fn.ctx.table == {1: 3.0}
        await backward(z, executor=ex)
    assert x.grad is not None and x.grad.data == 2.0
    assert w.grad is not None and w.grad.data == 3.0


async def test_a_remote_forward_sees_needs_input_grad_as_in_process(
    redis_server_url: str, shared_fleet: str
) -> None:
    # Each input's requires_grad, under no_grad() too (PyTorch's rule); ctx.recorded says
    # whether the client records the node.
    x = Parameter(1.0, role="x")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        recorded = await ex.apply(F.Needs, x, Variable(2.0))
        with no_grad():
            plain = await ex.apply(F.Needs, x, Variable(2.0))
    assert recorded.data == [True, False, True] and recorded.grad_fn is not None
    assert plain.data == [True, False, False] and plain.grad_fn is None


async def test_a_raw_value_a_remote_forward_returns_gets_none_as_in_process(
    redis_server_url: str, shared_fleet: str
) -> None:
    x = Parameter(1.0, role="x")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        out, raw = await ex.apply(F.WithRaw, x)
        assert raw.data == 7
        await backward(out, executor=ex)
    assert x.grad is not None and x.grad.data == 2.0  # 102.0 had the raw 7 got a zero


class LocalDouble(Function):
    """Changes its input in place (ctx.mark_dirty), in-process."""

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        x.data = x.data * 2
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Any:
        return g.data * 2


async def test_mark_dirty_is_refused_on_a_worker_and_checked_before_a_remote_backward(
    redis_server_url: str, shared_fleet: str
) -> None:
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        x = Parameter(1.0, role="x")
        with pytest.raises(RemoteError, match=r"mark_dirty\(\.\.\.\) on a worker"):
            await ex.apply(F.ScaleInPlace, Add.apply(x, Variable(0.0)))
        # Saved here by a remote Function's local forward, changed in place afterwards: the
        # remote backward is refused before its task is sent, as in-process.
        a = Add.apply(x, Variable(0.0))
        y = F.Double.apply(a)  # saves a
        LocalDouble.apply(a)
        with pytest.raises(BackwardError, match="modified by an inplace operation"):
            await backward(y, executor=ex)
    assert x.grad is None


class NotServed(Function):
    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


class OtherScale(Function):
    """Same registered name as agdist_functions.Scale, other code: a version mismatch."""

    dispatch = "remote"
    remote_name = "agdist.scale"

    @staticmethod
    def forward(ctx: Any, x: Variable, a: float) -> Variable:
        return Variable(x.data * a)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> tuple[Any, None]:
        return g.data, None


async def test_unknown_function_is_a_clear_error_not_a_timeout(
    redis_server_url: str, shared_fleet: str
) -> None:
    x = Parameter(1.0)
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with pytest.raises(RemoteError) as info:
            await backward(NotServed.apply(x), executor=ex)
    message = str(info.value)
    assert "NotServed" in message and repr(shared_fleet) in message and "--import" in message
    assert x.grad is None


async def test_fingerprint_mismatch_is_reported(redis_server_url: str, shared_fleet: str) -> None:
    x = Parameter(1.0)
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with pytest.raises(RemoteError, match="different code"):
            await backward(OtherScale.apply(x, 2.0), executor=ex)


async def test_remote_exception_carries_the_worker_traceback(
    redis_server_url: str, shared_fleet: str
) -> None:
    x = Parameter(1.0, role="x")
    y = F.Boom.apply(x)
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with pytest.raises(RemoteError) as info:
            await backward(y, executor=ex)
    error = info.value
    assert error.function == "Boom" and error.input_roles == ("x",)
    assert "ValueError: boom on 1.0" in str(error)
    assert "agdist_functions.py" in error.remote_traceback
    assert "raise ValueError" in error.remote_traceback
    assert error.__cause__ is not None and "traceback on the worker" in str(error.__cause__)


class HoldsALock(Function):
    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        ctx.lock = threading.Lock()
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:
        return g


async def test_unserializable_ctx_attribute_is_named(
    redis_server_url: str, shared_fleet: str
) -> None:
    y = HoldsALock.apply(Parameter(1.0))
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with pytest.raises(BackwardError) as info:
            await backward(y, executor=ex)
    cause = info.value.__cause__
    assert isinstance(cause, TypeError)
    assert "HoldsALock" in str(cause) and "'lock'" in str(cause) and "lock" in str(cause)


class TooDeep(Function):
    """Packs on the client, but nests deeper than a worker's limit: the worker refuses it."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        nested: Any = 1
        for _ in range(80):
            nested = [nested]
        ctx.nested = nested
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, g: Variable) -> Variable:  # pragma: no cover - never runs
        return g


async def test_a_task_the_workers_refuse_fails_at_once_not_at_the_timeout(
    redis_server_url: str, shared_fleet: str
) -> None:
    x = Parameter(1.0, role="x")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=30) as ex:
        with anyio.fail_after(10):
            with pytest.raises(RemoteError, match="refused the task: message nests deeper"):
                await backward(TooDeep.apply(x), executor=ex)
        assert ex.stats.completed == 1


async def test_a_reply_the_client_rejects_fails_its_task_at_once(
    redis_server_url: str, shared_fleet: str
) -> None:
    from asyncgraph.distributed import Limits

    x = Parameter("ab", role="x")
    # Unsigned workers answer unsigned replies; a client with a secret rejects them.
    async with open_redis_executor(
        redis_server_url, queue=shared_fleet, timeout_s=30, secret="a-client-only-secret-16"
    ) as ex:
        with anyio.fail_after(10):
            with pytest.raises(RemoteError, match=r"unsigned message.*share one secret") as info:
                await backward(F.Noop.apply(x), "fb", executor=ex)
        assert info.value.function == "Noop" and ex.stats.rejected_replies == 1
    # A reply above this client's limit is skipped unread, and fails its task.
    async with open_redis_executor(
        redis_server_url, queue=shared_fleet, timeout_s=30, limits=Limits(max_message_bytes=2000)
    ) as ex:
        with anyio.fail_after(10):
            with pytest.raises(RemoteError, match="above this client's limit of 2000"):
                await backward(F.Expand.apply(x, 50_000), "fb", executor=ex)
    assert x.grad is None


async def test_remote_backward_refuses_create_graph(
    redis_server_url: str, shared_fleet: str
) -> None:
    y = F.Scale.apply(Parameter(1.0), 2.0)
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with pytest.raises(BackwardError) as info:
            await backward(y, create_graph=True, executor=ex)
    assert isinstance(info.value.__cause__, GraphError)
    assert "create_graph" in str(info.value.__cause__)


@pytest.mark.anyio
async def test_an_error_in_the_block_comes_out_unwrapped(redis_url: str) -> None:
    with pytest.raises(KeyError, match="mine"):
        async with open_redis_executor(redis_url, queue="unwrap"):
            raise KeyError("mine")


async def test_model_usage_spent_on_workers_counts_for_the_caller(
    redis_server_url: str, shared_fleet: str
) -> None:
    from asyncgraph.models import SimulatedModel, track_usage

    x = Parameter("draft", role="x")
    outs = [F.Ask.apply(x) for _ in range(3)]
    local = SimulatedModel(latency_s=0.0, responder=lambda messages: "a b")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        with track_usage() as usage:
            await local.complete([{"role": "user", "content": "here"}])
            await backward(outs, ["fb"] * 3, executor=ex)
    spent = usage.snapshot()
    assert spent.requests == 4  # one here, three on the workers
    # "[simulated] one two three" is 4 words; "feedback on fb" 3; here: 1 + 3 ("[simulated] a b")
    assert spent.completion_tokens == 3 * 4 + 3
    assert spent.prompt_tokens == 3 * 3 + 1


async def test_a_task_hook_sends_opaque_metadata_from_the_worker_to_the_client(
    redis_server_url: str, shared_fleet: str
) -> None:
    F.WhereRan.seen.clear()
    x = Parameter(1.0, role="x")
    async with open_redis_executor(redis_server_url, queue=shared_fleet, timeout_s=20) as ex:
        await backward([F.Scale.apply(x, 2.0) for _ in range(3)], executor=ex)
    assert len(F.WhereRan.seen) == 3
    assert all(isinstance(m["pid"], int) and m["pid"] != os.getpid() for m in F.WhereRan.seen)
    # and what the client side sent with the task reached the worker side
    assert all(m["client_said"] == {"sent_by": os.getpid()} for m in F.WhereRan.seen)
