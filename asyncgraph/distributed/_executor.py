"""RedisExecutor: run ``dispatch = "remote"`` backwards on a worker fleet fed through Redis.

The Executor face of the fleet: it builds a task message for each remote node (or
remote forward), hands it to its ``TaskChannel`` (``_channel.py``: batching, the
reply listener, deadlines, cancellation, heartbeat), and turns what comes back into
the node's result or a ``RemoteError`` / ``RemoteTimeoutError`` with a diagnosis.
Nodes that are not remote run on ``local``. Cancelling the caller cancels its tasks
on the workers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import anyio

from asyncgraph import (
    BackwardError,
    Executor,
    Function,
    GraphError,
    LocalExecutor,
    RemoteConnectionError,
    RemoteError,
    RemoteTimeoutError,
    Variable,
    WireError,
    is_grad_enabled,
)
from asyncgraph.distributed._channel import RedisExecutorStats, TaskChannel, _Pending
from asyncgraph.distributed.wire import _keys as keys
from asyncgraph.distributed.wire._limits import DEFAULT_LIMITS, Limits
from asyncgraph.distributed.wire._payload import (
    backward_payload,
    diagnose_unpackable,
    fingerprint,
    forward_payload,
    read_backward_result,
    read_forward_result,
    remote_name,
    restore_ctx,
)
from asyncgraph.distributed.wire._schema import TaskMessage, encode
from asyncgraph.distributed.wire._signing import Signer, secret_from_env
from asyncgraph.resp import Pool, RedisConnectionLost, ReplyError, parse_redis_url
from asyncgraph.taskhooks import task_hooks

if TYPE_CHECKING:
    from asyncgraph import Node

__all__ = ["RedisExecutor", "RedisExecutorStats", "open_redis_executor"]

log = logging.getLogger("asyncgraph.distributed")


def _forward_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward's inputs as they travel (a Variable as its data), for naming the one that
    cannot: ``args[0]``, ``kwargs.scale``, ..."""

    def value(v: Any) -> Any:
        return v.data if isinstance(v, Variable) else v

    return {
        **{f"args[{i}]": value(v) for i, v in enumerate(args)},
        **{f"kwargs.{k}": value(v) for k, v in kwargs.items()},
    }


def _nothing_more() -> bool:
    return False


class _RemoteTraceback(Exception):
    """Carries a worker's traceback text as the ``__cause__`` of a RemoteError."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return f"\n\n--- traceback on the worker ---\n{self.args[0]}"


class RedisExecutor:
    """An :class:`~asyncgraph.Executor` that sends remote nodes to ``asyncgraph worker``\\ s.

    Create it with :func:`open_redis_executor`. Nodes whose Function has
    ``dispatch = "remote"`` go to the queue; the others run on ``local`` (a
    LocalExecutor by default), so cheap nodes never cross the network.

    ``await ex.apply(MyFunction, *args, **kwargs)`` runs a remote Function's
    *forward* on a worker too and records the node locally, as
    ``MyFunction.apply`` would.

    Example::

        async with open_redis_executor("redis://127.0.0.1:6379/0", queue="grads") as ex:
            answer = await ex.apply(LLMCall, prompt, question, model="openai:gpt-4o-mini")
            loss = await TextLoss("Is the answer right?", model="openai:gpt-4o-mini")(answer)
            await loss.backward(executor=ex)
    """

    def __init__(
        self,
        pool: Pool,
        queue: str,
        *,
        signer: Signer,
        timeout_s: float,
        local: Executor,
        limits: Limits,
        run_id: bytes | None,
    ) -> None:
        # A cancelled task's worker reports what it spent (e.g. model usage): for the hooks.
        self.channel = TaskChannel(
            pool,
            queue,
            signer=signer,
            timeout_s=timeout_s,
            limits=limits,
            run_id=run_id,
            on_report=_on_reply_metadata,
            on_timeout=self._timed_out,
        )
        self.queue = queue
        self.client_id = self.channel.client_id
        self.timeout_s = timeout_s
        self.local = local
        self.stats = self.channel.stats
        self._pool = pool
        self._signer = signer
        self._limits = limits
        self._start_soon: Callable[..., object] | None = None  # the executor's task group's

    # -- Executor protocol -------------------------------------------------------
    def inline(self, node: Node) -> bool:
        if node.function.dispatch == "remote":
            return False
        return self.local.inline(node)

    async def run_backward_batched(
        self,
        node: Node,
        grad_outputs: tuple[Variable | None, ...],
        more_coming: Callable[[], bool],
    ) -> Any:
        """``run_backward``, told by the engine whether more ready nodes are on their way
        (the core's ``BatchingExecutor`` protocol): the last one sends the batch.

        One coroutine from here to the reply (a wide pass holds one per node in flight:
        every frame less is less for the garbage collector to walk).
        """
        fn = node.function
        if fn.dispatch != "remote":
            return await self.local.run_backward(node, grad_outputs)
        task_id, name, packed, signature = self._backward_task(node, grad_outputs)
        pending = await self.channel.send_and_wait(task_id, name, packed, signature, more_coming)
        result = await self._result(pending, fn, node, node.input_roles)
        return read_backward_result(result)

    async def run_backward(self, node: Node, grad_outputs: tuple[Variable | None, ...]) -> Any:
        return await self.run_backward_batched(node, grad_outputs, _nothing_more)

    # -- submitted nodes (the core's SubmittingExecutor protocol) -----------------------
    def submits(self, node: Node) -> bool:
        return node.function.dispatch == "remote"

    def submit_backward(
        self, node: Node, grad_outputs: tuple[Variable | None, ...], done: Any
    ) -> _Pending:
        """Queue a remote node's backward with no task waiting for it (NOTE [Submitted
        nodes] in the engine): ``done.put(handle)`` once its reply, its failure, or its
        timeout (diagnosed) is in."""
        task_id, name, packed, signature = self._backward_task(node, grad_outputs)
        pending = self.channel.submit(task_id, name, packed, signature, done)
        pending.node = node
        return pending

    async def send_submitted(self) -> None:
        await self.channel.send_submitted()

    def collect_backward(self, pending: _Pending) -> Any:
        """The backward result of a submitted node whose outcome is in, or its error raised."""
        self.channel.completed(pending)
        node = pending.node
        result = self._reply_result(pending, node.function, node, node.input_roles)
        return read_backward_result(result)

    async def abandon_submitted(self, pendings: list[_Pending]) -> None:
        await self.channel.abandon(pendings)

    def _timed_out(self, pending: _Pending) -> None:
        """The channel's word that a submitted task got no reply in time: diagnose it off
        the engine's path (a task of the executor's group), then tell its node."""
        if self._start_soon is None:  # not open: nothing to ask Redis with
            self._tell_timed_out(pending, "not diagnosed: the executor is not open")
            return
        self._start_soon(self._diagnose_timeout, pending)

    async def _diagnose_timeout(self, pending: _Pending) -> None:
        diagnosis = "not diagnosed: the executor closed first"
        try:
            diagnosis = await self._diagnosis(pending)
        except Exception as exc:  # never the executor's other tasks' failure
            diagnosis = f"could not ask Redis why ({type(exc).__name__}: {exc})"
        finally:
            self._tell_timed_out(pending, diagnosis)

    def _tell_timed_out(self, pending: _Pending, diagnosis: str) -> None:
        node = pending.node
        pending.error = self._timeout_error(
            pending, node.function, node, node.input_roles, diagnosis
        )
        pending.done.put(pending)

    def _backward_task(
        self, node: Node, grad_outputs: tuple[Variable | None, ...]
    ) -> tuple[str, str, bytes, bytes]:
        fn = node.function
        if is_grad_enabled():
            raise GraphError(
                f"{node.describe()} has dispatch='remote', and a remote backward cannot be "
                f"recorded for create_graph=True (its operations run on a worker). Run this "
                f"backward with create_graph=False, or set {fn.__name__}.dispatch = 'local'."
            )
        try:
            payload = backward_payload(node, grad_outputs)
        except TypeError as exc:  # pragma: no cover - ctx_state only reads attributes
            raise TypeError(f"{fn.__name__}: {exc}") from None
        return self._encode(
            fn,
            "backward",
            payload,
            node.ctx,
            lambda: {"grad_outputs": [g.data if g else None for g in grad_outputs]},
        )

    # -- remote forward -------------------------------------------------------------
    async def apply(self, fn: type[Function], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``'s forward on a worker, record the node here, return its output(s).

        Same result as ``fn.apply(*args, **kwargs)`` (grad recorded when an input
        requires grad), with the forward running remotely; ``fn`` must have
        ``dispatch = "remote"`` and be served by the workers.
        """
        if not (isinstance(fn, type) and issubclass(fn, Function)) or fn.dispatch != "remote":
            raise TypeError(f"apply expects a Function subclass with dispatch='remote', got {fn!r}")
        application = fn.application(args, kwargs)  # what fn.apply reads at call time
        ctx = application.ctx
        # "needs" on the wire: the gradients a recorded node will be asked for (all False
        # when not recorded); the worker reads each input's requires_grad from its entry.
        inputs = application.inputs  # signature order, as fn.apply records them
        needs = ctx.needs_input_grad if application.recorded else (False,) * len(inputs)
        payload = forward_payload(args, kwargs, needs)
        roles = tuple(v.role if isinstance(v, Variable) else "" for v in inputs)
        task_id, name, packed, signature = self._encode(
            fn, "forward", payload, None, lambda: _forward_values(args, kwargs)
        )
        pending = await self.channel.send_and_wait(task_id, name, packed, signature, _nothing_more)
        result = await self._result(pending, fn, None, roles)
        try:
            returned = read_forward_result(result)
            restore_ctx(ctx, returned.ctx, fn)
        except WireError as exc:
            raise RemoteError(
                f"{fn.__name__}.forward on queue {self.queue!r} returned a malformed result: {exc}",
                function=fn.__name__,
                input_roles=roles,
            ) from None
        outputs = returned.outputs
        if returned.non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in returned.non_differentiable))
        # What forward returned raw goes to be recorded raw, as in-process (no zero for it).
        raw = returned.raw or ()
        output = [out.data if i in raw else out for i, out in enumerate(outputs)]
        return application.finish(tuple(output) if returned.is_tuple else output[0])

    # -- submitting and waiting -------------------------------------------------------
    def _encode(
        self,
        fn: type[Function],
        op: Literal["backward", "forward"],
        payload: dict[str, Any],
        ctx: Any,
        values: Callable[[], dict[str, Any]],
    ) -> tuple[str, str, bytes, bytes]:
        """The task's id, remote name, message and signature.

        A value that cannot travel raises the TypeError of ``diagnose_unpackable``, which
        names it among ``ctx``'s and ``values()``'s.
        """
        if self.channel.closed:
            raise RuntimeError(
                f"this RedisExecutor (queue {self.queue!r}) is closed: use it inside its "
                f"`async with open_redis_executor(...)` block"
            )
        name = remote_name(fn)
        task_id = self.channel.next_task_id()
        ttl_ms = max(1, int(self.timeout_s * 1000))
        message = TaskMessage(
            self.queue,
            self.client_id,
            task_id,
            name,
            fingerprint(fn),
            op,
            ttl_ms,
            payload,
            _task_metadata(),
            # Signed with the task: NOTE [Replays] in ``worker._admission``.
            expiry_ms=int(self.channel.redis_now_ms()) + ttl_ms,
        )
        try:
            packed, signature = encode(message, self._signer, self._limits)
        except TypeError:
            raise diagnose_unpackable(fn, ctx, values()) from None
        return task_id, name, packed, signature

    async def _result(
        self,
        pending: _Pending,
        fn: type[Function],
        node: Node | None,
        input_roles: tuple[str, ...],
    ) -> Any:
        """The task's result (its metadata handed to the hooks), or the error saying why not.

        Called once the wait is over: no frame of it is held while the task waits.
        """
        if pending.timed_out:
            diagnosis = await self._diagnosis(pending)
            raise self._timeout_error(pending, fn, node, input_roles, diagnosis)
        return self._reply_result(pending, fn, node, input_roles)

    def _reply_result(
        self,
        pending: _Pending,
        fn: type[Function],
        node: Node | None,
        input_roles: tuple[str, ...],
    ) -> Any:
        """The result of a task whose reply or failure is in (metadata handed to the hooks),
        or its error raised: the failure's own, or a ``RemoteError`` for the worker's."""
        reply = pending.reply
        if reply is not None:
            if reply.meta:
                _on_reply_metadata(reply.meta)
            if reply.error is None:
                return reply.result
        describe = node.describe() if node is not None else f"{fn.__name__}.forward"
        output_roles = node.output_roles if node is not None else ()
        if pending.error is not None:
            error = pending.error
            if isinstance(error, BackwardError) and not error.function:
                error.function, error.input_roles, error.output_roles = (
                    fn.__name__,
                    input_roles,
                    output_roles,
                )
                error.args = (f"{describe}: {error.args[0]}",)
            raise error
        assert reply is not None and reply.error is not None
        info = reply.error
        remote = RemoteError(
            f"{describe} failed on worker {reply.worker!r} (queue {self.queue!r}): "
            + (f"{info.type}: {info.message}" if info.kind == "error" else info.message),
            remote_traceback=info.traceback,
            function=fn.__name__,
            input_roles=input_roles,
            output_roles=output_roles,
        )
        if info.traceback:
            raise remote from _RemoteTraceback(info.traceback)
        raise remote

    async def _diagnosis(self, pending: _Pending) -> str:
        """Why a task got no reply, as Redis shows it; then the task is cancelled."""
        try:
            # Asked before the task is cancelled (which deletes it from the stream), so
            # the diagnosis sees where it was: queued, being processed, or gone.
            return await self.channel.diagnose(pending)
        finally:
            self.channel.send_cancel(pending)

    def _timeout_error(
        self,
        pending: _Pending,
        fn: type[Function],
        node: Node | None,
        input_roles: tuple[str, ...],
        diagnosis: str,
    ) -> RemoteTimeoutError:
        """The error of a task that got no reply within ``timeout_s``."""
        describe = node.describe() if node is not None else f"{fn.__name__}.forward"
        return RemoteTimeoutError(
            f"{describe}: no reply from the workers of queue {self.queue!r} within "
            f"{self.timeout_s:g}s (task {pending.task_id}, function {pending.function!r}); "
            f"{diagnosis}",
            function=fn.__name__,
            input_roles=input_roles,
            output_roles=node.output_roles if node is not None else (),
        )

    def __repr__(self) -> str:
        return (
            f"RedisExecutor(url={self._pool.address.display!r}, queue={self.queue!r}, "
            f"timeout_s={self.timeout_s!r})"
        )


def _task_metadata() -> dict[str, Any] | None:
    """What each task hook's worker side should know of this task (e.g. a trace context)."""
    meta = {}
    for name, hook in task_hooks().items():
        try:
            value = hook.task_metadata()
        except Exception:  # a hook must not fail the node it observes
            log.exception("task hook %r failed to give a task's metadata", name)
            continue
        if value is not None:
            meta[name] = value
    return meta or None


def _on_reply_metadata(meta: dict[str, Any]) -> None:
    """Hand each task hook what its worker side sent back (e.g. model usage, for totals)."""
    hooks = task_hooks()
    for name, value in meta.items():
        hook = hooks.get(name)
        if hook is None:
            continue
        try:
            hook.on_reply(value)
        except Exception as exc:  # malformed metadata, or a hook's bug: not the node's failure
            log.warning(
                "ignoring malformed %r metadata from a worker: %s (%.200r)", name, exc, value
            )


@asynccontextmanager
async def open_redis_executor(
    url: str,
    queue: str = "grads",
    *,
    secret: str | bytes | None = None,
    timeout_s: float = 600.0,
    redis_timeout_s: float = 5.0,
    local: Executor | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> AsyncIterator[RedisExecutor]:
    """Open a :class:`RedisExecutor` on ``url`` / ``queue`` for the block's duration.

    ``secret``: shared with the workers (``--secret`` / ``ASYNCGRAPH_SECRET``);
    tasks are signed and replies must be. None (the default) reads
    ``ASYNCGRAPH_SECRET`` from the environment when it is set; ``""`` disables
    signing explicitly. ``timeout_s``: how long one remote
    node may take from submission to reply (also its deadline on the workers).
    ``redis_timeout_s``: bound on every Redis call; an unreachable Redis raises
    ``RemoteConnectionError`` here, and one lost mid-pass fails the waiting
    nodes within about that long. ``local``: runs the nodes that are not
    ``dispatch = "remote"`` (default: a new LocalExecutor). ``rediss://`` URLs
    and ACL ``user:password@`` work as in redis-py.

    Example::

        async with open_redis_executor("redis://127.0.0.1:6379/0", queue="grads") as ex:
            await loss.backward(executor=ex)
    """
    keys.check_queue_name(queue)
    if not 0 < timeout_s <= keys.MAX_TTL_MS / 1000:
        raise ValueError(
            f"timeout_s must be > 0 and at most {keys.MAX_TTL_MS // 1000} s (7 days: workers "
            f"refuse a task that says it waits longer), got {timeout_s!r}"
        )
    if secret is None:
        secret = secret_from_env()
    signer = Signer(secret or None)  # "" (or b""): explicitly unsigned
    address = parse_redis_url(url)
    pool = Pool(address, timeout_s=redis_timeout_s)
    executor = RedisExecutor(
        pool,
        queue,
        signer=signer,
        timeout_s=timeout_s,
        local=local if local is not None else LocalExecutor(),
        limits=limits,
        run_id=None,
    )
    try:
        # Tasks sent before any worker exists must wait for it: create the group at 0.
        # Sent again after a lost connection: a repeat answers BUSYGROUP, read as done.
        await pool.execute(
            "XGROUP", "CREATE", keys.task_stream(queue), keys.GROUP, "0", "MKSTREAM", retry=True
        )
    except ReplyError as exc:
        if exc.code != "BUSYGROUP":
            await pool.aclose()
            raise RemoteConnectionError(
                f"Redis at {address.display} refused to set up queue {queue!r}: {exc}"
            ) from None
    except RedisConnectionLost as exc:
        await pool.aclose()
        raise RemoteConnectionError(f"{exc} (queue {queue!r})") from exc
    try:
        listener = await executor.channel.connect_listener()
    except RedisConnectionLost as exc:
        await pool.aclose()
        raise RemoteConnectionError(f"{exc} (queue {queue!r})") from exc
    try:
        # Before any task: workers skip the tasks of a client whose heartbeat key is gone.
        await executor.channel.beat()
    except (RedisConnectionLost, ReplyError) as exc:
        await listener.aclose()
        await pool.aclose()
        raise RemoteConnectionError(
            f"Redis at {address.display} refused this client's heartbeat on queue {queue!r}: {exc}"
        ) from exc
    body_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            executor._start_soon = tg.start_soon  # (a timed-out node's diagnosis)
            tg.start_soon(executor.channel.listen, listener)
            tg.start_soon(executor.channel.flush_loop)
            tg.start_soon(executor.channel.watch_deadlines)
            tg.start_soon(executor.channel.heartbeat)
            try:
                yield executor
            except Exception as exc:
                # Re-raised below as itself, not wrapped in the task group's ExceptionGroup.
                body_error = exc
            finally:
                tg.cancel_scope.cancel()
    finally:
        executor._start_soon = None
        await executor.channel.close()
    if body_error is not None:
        raise body_error
