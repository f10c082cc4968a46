"""Remote Functions served by the worker processes of tests/distributed (``--import agdist_functions``).

Functions that need to tell the test what happened on the worker write to Redis
at ``AGDIST_REDIS_URL`` (synchronous redis-py, in a worker thread: ``blocking = True``).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import anyio

from asyncgraph import Function, Variable
from asyncgraph.taskhooks import install_task_hook


class WhereRan:
    """A task hook of the tests' own: each reply carries the pid of the worker that ran it."""

    name = "agdist"
    seen: ClassVar[list[Any]] = []  # on the client: what came back

    def serving(self, settings: Any) -> Any:
        return lambda: None

    def task_metadata(self) -> Any:
        return {"sent_by": os.getpid()}

    def around_task(self, metadata: Any, info: Any) -> Any:
        from contextlib import nullcontext

        return nullcontext(lambda: {"pid": os.getpid(), "client_said": metadata})

    def on_reply(self, metadata: Any) -> None:
        self.seen.append(metadata)


install_task_hook(WhereRan())


def _redis() -> Any:
    import redis

    return redis.Redis.from_url(os.environ["AGDIST_REDIS_URL"])


class Shout(Function):
    """Text: upper-cases; backward returns feedback naming the input."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, text: Variable) -> Variable:
        ctx.save_for_backward(text)
        ctx.prefix = "calm"
        return Variable(text.data.upper(), role="shout")

    @staticmethod
    async def backward(ctx: Any, feedback: Variable | None) -> Variable:
        (text,) = ctx.saved_variables
        fb = feedback.data if feedback is not None else None
        return Variable(f"{ctx.prefix}: {text.data!r} <- {fb!r}", role=f"fb for {text.role}")


class Scale(Function):
    """Numbers: y = a * x; sync backward (runs inline on the worker)."""

    dispatch = "remote"
    remote_name = "agdist.scale"

    @staticmethod
    def forward(ctx: Any, x: Variable, a: float) -> Variable:
        ctx.save_for_backward(x)
        ctx.a = a
        ctx.shape = (1, 2)
        return Variable(x.data * a)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> tuple[Any, None]:
        assert ctx.shape == (1, 2), ctx.shape  # tuples stay tuples
        return grad.data * ctx.a, None


class Split(Function):
    """Two outputs; blocking sync backward (runs in a worker thread)."""

    dispatch = "remote"
    blocking = True

    @staticmethod
    def forward(ctx: Any, x: Variable) -> tuple[Variable, Variable]:
        return Variable(x.data * 2.0), Variable(x.data * 3.0)

    @staticmethod
    def backward(ctx: Any, g1: Variable | None, g2: Variable | None) -> float:
        return (g1.data if g1 is not None else 0.0) * 2.0 + (
            g2.data if g2 is not None else 0.0
        ) * 3.0


class Sleep(Function):
    """Sleeps ``ctx.seconds`` in backward, recording start/finish/cancel in Redis under ``ctx.tag``."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, seconds: float, tag: str) -> Variable:
        ctx.seconds = seconds
        ctx.tag = tag
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Any:
        client = _redis()
        try:
            await anyio.to_thread.run_sync(client.rpush, f"agdist:started:{ctx.tag}", os.getpid())
            try:
                await anyio.sleep(ctx.seconds)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(
                        client.rpush, f"agdist:cancelled:{ctx.tag}", os.getpid()
                    )
                raise
            await anyio.to_thread.run_sync(client.rpush, f"agdist:finished:{ctx.tag}", os.getpid())
        finally:
            client.close()
        return grad.data, None, None


class Noop(Function):
    """The cheapest remote node: identity."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Variable:
        return grad


class Boom(Function):
    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Variable:
        raise ValueError(f"boom on {grad.data!r}")


class Crash(Function):
    """Kills the worker process in backward (a poison task)."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Variable:
        _redis().rpush("agdist:crashes", os.getpid())
        time.sleep(0.05)
        os._exit(17)


class Double(Function):
    """Remote forward and backward (for RedisExecutor.apply)."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        ctx.save_for_backward(x)
        ctx.factor = 2
        return Variable(x.data * 2, role="doubled")

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Any:
        (x,) = ctx.saved_variables
        assert x.data is not None  # saved variables travel with the task
        return grad.data * ctx.factor


class Needs(Function):
    """Remote forward that answers what its ctx says: needs_input_grad, then recorded."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, y: Variable) -> Variable:
        return Variable([*ctx.needs_input_grad, ctx.recorded], role="needs")

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Any:
        return None, None


class WithRaw(Function):
    """Remote forward returning a raw number beside a Variable: backward gets None for it."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return Variable(x.data * 2), 7

    @staticmethod
    def backward(ctx: Any, grad: Variable, g_raw: Variable | None) -> Any:
        return grad.data * 2 + (0 if g_raw is None else 100)


class ScaleInPlace(Function):
    """A remote forward that tries to change its input in place: refused on a worker."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        x.data = x.data * 2
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Any:
        return grad.data * 2


class Ask(Function):
    """Remote backward that calls a (simulated) model: its usage travels back in the reply."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Variable:
        return Variable(x.data, role="asked")

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Any:
        from asyncgraph.models import SimulatedModel

        model = SimulatedModel(latency_s=0.0, responder=lambda messages: "one two three")
        reply = await model.complete([{"role": "user", "content": f"feedback on {grad.data}"}])
        return reply.text


class SyncSleep(Function):
    """Synchronous backward that blocks for ``ctx.seconds`` (time.sleep), recording when.

    Not ``blocking = True``: on a worker every synchronous backward runs in a thread anyway,
    so the event loop keeps renewing leases while it sleeps.
    """

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, seconds: float, tag: str) -> Variable:
        ctx.seconds = seconds
        ctx.tag = tag
        return Variable(x.data)

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> Any:
        client = _redis()
        try:
            client.rpush(f"agdist:sync-started:{ctx.tag}", f"{os.getpid()} {time.time()}")
            time.sleep(ctx.seconds)
            client.rpush(f"agdist:sync-finished:{ctx.tag}", f"{os.getpid()} {time.time()}")
        finally:
            client.close()
        return grad.data, None, None


class Table(Function):
    """Numbers with an int-keyed dict on ctx: y = x * table[1]; the dict travels both ways."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, table: dict[int, float]) -> Variable:
        ctx.table = table
        return Variable(x.data * table[1])

    @staticmethod
    def backward(ctx: Any, grad: Variable) -> tuple[Any, None]:
        assert all(isinstance(k, int) for k in ctx.table), ctx.table
        return grad.data * ctx.table[1], None


class Expand(Function):
    """Text: backward returns the feedback repeated ``ctx.times`` times (a big reply)."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, times: int) -> Variable:
        ctx.times = times
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> tuple[str, None]:
        return str(grad.data) * ctx.times, None


class Nap(Function):
    """Async backward that only sleeps ``ctx.seconds`` (touches nothing else in Redis)."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, seconds: float) -> Variable:
        ctx.seconds = seconds
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Any:
        await anyio.sleep(ctx.seconds)
        return grad.data, None


class Held(Function):
    """Async backward that holds while Redis key ``agdist:hold:<tag>`` exists, recording
    start and finish as ``Sleep`` does: a test sets the key, sees the tasks start, does
    what it must while they run (however slowly it polls), then deletes the key."""

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, tag: str) -> Variable:
        ctx.tag = tag
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Any:
        client = _redis()
        try:
            await anyio.to_thread.run_sync(client.rpush, f"agdist:started:{ctx.tag}", os.getpid())
            with anyio.fail_after(120):
                # Polled: the flag is set and cleared by the test, in another process.
                while await anyio.to_thread.run_sync(client.exists, f"agdist:hold:{ctx.tag}"):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(client.rpush, f"agdist:finished:{ctx.tag}", os.getpid())
        finally:
            client.close()
        return grad.data, None


class AskThenHold(Function):
    """Remote backward that asks an OpenAI-compatible server (``ctx.base_url``) and then
    holds while Redis key ``agdist:hold:<tag>`` exists: a test can kill the worker after
    the model call returned and before the reply. The prompt is ``agdist:prompt:<tag>``
    if set (a test changes it between runs), else ``ctx.prompt``; each run pushes its pid
    on ``agdist:called:<tag>`` once its call returned. The gradient is ``grad`` times the
    length of the answer, so a replayed answer must be the same to give the same gradient.
    """

    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable, base_url: str, prompt: str, tag: str) -> Variable:
        ctx.base_url, ctx.prompt, ctx.tag = base_url, prompt, tag
        return Variable(x.data)

    @staticmethod
    async def backward(ctx: Any, grad: Variable) -> Any:
        from asyncgraph.models import OpenAIChat, Pricing

        client = _redis()
        try:
            prompt = await anyio.to_thread.run_sync(client.get, f"agdist:prompt:{ctx.tag}")
            async with OpenAIChat(
                "gpt-test", ctx.base_url, "sk-test", pricing=Pricing(1.0, 2.0)
            ) as model:
                reply = await model.complete(
                    [{"role": "user", "content": prompt.decode() if prompt else ctx.prompt}]
                )
            await anyio.to_thread.run_sync(client.rpush, f"agdist:called:{ctx.tag}", os.getpid())
            with anyio.fail_after(60):
                # Polled: the flag is set and cleared by the test, in another process.
                while await anyio.to_thread.run_sync(client.exists, f"agdist:hold:{ctx.tag}"):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        finally:
            client.close()
        return grad.data * len(reply.text), None, None, None
