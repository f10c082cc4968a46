"""OpenTelemetry traces of backward passes, across the fleet (the ``otel`` extra).

``with otel_tracing():`` around your code gives, in the tracer provider you configured
(or the one passed):

- a span per backward pass (``asyncgraph.backward``), the parent of
- a span per node (``<Function>.backward``: function, input and output roles, local or
  remote, failed nodes with their error), the parent of
- a span per model call made inside it, following the OpenTelemetry GenAI semantic
  conventions (``chat <model>``: ``gen_ai.*`` model and token counts, finish reason,
  plus whether it was cached, its retries and its cost; prompt and reply text only with
  ``capture_content=True``);
- on a worker, a span per remote task (``asyncgraph.task <function>``: queue wait,
  delivery, worker), the child of the client's node span: the trace context travels in
  the task message, so one trace shows the whole pass across machines.

A worker started by ``asyncgraph worker`` exports its spans when OpenTelemetry's usual
variables say where (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, OTLP over HTTP/protobuf) or when
``ASYNCGRAPH_OTEL=1`` (then the SDK's own defaults apply); see ``setup_worker_from_env``.

Without this module imported nothing of OpenTelemetry is loaded and no observer is
installed: tracing off costs nothing.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - exercised where the extra is missing
    from asyncgraph._install import install_hint

    raise ImportError(
        f"asyncgraph.observe.otel needs OpenTelemetry: {install_hint('otel')}"
    ) from exc


import asyncgraph
from asyncgraph import NodeEvent, PassInfo, observe_nodes, observe_passes
from asyncgraph._redact import redact, url_host
from asyncgraph.models import ModelCall, observe_calls
from asyncgraph.taskhooks import TaskInfo, install_task_hook, task_hooks

__all__ = ["OTelTracing", "otel_tracing", "setup_worker_from_env"]

HOOK_NAME = "otel"
_PROPAGATOR = TraceContextTextMapPropagator()
# The node spans a pass has open: id(span) -> (span, its context token, id(node)). Set by
# the pass, so its tasks see it; what is left at the pass's end was cancelled.
_OPEN: contextvars.ContextVar[dict[int, tuple[Any, Any, int]] | None] = contextvars.ContextVar(
    "asyncgraph_otel_open_spans", default=None
)


class OTelTracing:
    """The tracer, listeners and task hook behind ``otel_tracing`` (one per provider).

    Example::

        with otel_tracing() as tracing:       # an OTelTracing
            await loss.backward(executor=redis_executor)
    """

    name = HOOK_NAME

    def __init__(self, tracer_provider: Any = None, *, capture_content: bool = False) -> None:
        self.tracer = trace.get_tracer(
            "asyncgraph", asyncgraph.__version__, tracer_provider=tracer_provider
        )
        self.capture_content = capture_content

    # -- passes and nodes (engine observers) --------------------------------------------
    @contextmanager
    def on_pass(self, info: PassInfo) -> Iterator[None]:
        with self.tracer.start_as_current_span(
            "asyncgraph.backward",
            attributes={
                "asyncgraph.roots": info.roots,
                "asyncgraph.create_graph": info.create_graph,
                "asyncgraph.executor": info.executor,
            },
            # Recorded here, redacted: the SDK's own recording would copy the error's text.
            record_exception=False,
            set_status_on_exception=False,
        ) as pass_span:
            opened: dict[int, tuple[Any, Any, int]] = {}
            token = _OPEN.set(opened)  # the pass's tasks inherit it
            try:
                yield
            except Exception as exc:
                _record_error(pass_span, exc)
                raise
            finally:
                _OPEN.reset(token)
                for span, _, _ in opened.values():
                    # Never finished: cancelled (another node failed, or the pass was).
                    span.set_attribute("asyncgraph.cancelled", True)
                    span.set_status(Status(StatusCode.ERROR, "cancelled before it finished"))
                    span.end()

    def on_node(self, event: NodeEvent) -> None:
        opened = _OPEN.get()
        if opened is None:
            return
        if event.kind == "started":
            if not trace.get_current_span().get_span_context().trace_flags.sampled:
                # The pass was not sampled: no node span (its context, unsampled, still
                # reaches the workers, which record nothing either).
                return
            node = event.node
            remote = node is not None and node.function.dispatch == "remote"
            span = self.tracer.start_span(
                f"{event.function}.backward",
                attributes={
                    "asyncgraph.function": event.function,
                    "asyncgraph.input_roles": event.input_roles,
                    "asyncgraph.output_roles": event.output_roles,
                    "asyncgraph.remote": remote,
                },
            )
            token = otel_context.attach(trace.set_span_in_context(span))
            opened[id(span)] = (span, token, id(node))
            return
        # The node finishes in the task that started it, where its span is current.
        span = trace.get_current_span()
        entry = opened.get(id(span))
        if entry is None or entry[2] != id(event.node):
            return  # not traced (unsampled), or not this node's
        del opened[id(span)]
        if event.kind == "failed" and event.error is not None:
            _record_error(span, event.error)
        otel_context.detach(entry[1])
        span.end()

    # -- model calls (GenAI semantic conventions) ------------------------------------------
    def on_call(self, call: ModelCall) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": _system(call.endpoint),
            "gen_ai.request.model": call.model,
            "gen_ai.usage.input_tokens": call.prompt_tokens,
            "gen_ai.usage.output_tokens": call.completion_tokens,
            "asyncgraph.cached": call.cached,
            "asyncgraph.retries": call.retries,
        }
        if call.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [call.finish_reason]
        if call.cost_usd is not None:
            attributes["asyncgraph.cost_usd"] = call.cost_usd
        host, _, port = url_host(call.endpoint).rpartition(":")
        if not host or "]" in port:  # no port (or an IPv6 address without one)
            host, port = url_host(call.endpoint), ""
        if host:  # the host alone: never a URL's port, userinfo, path or query
            attributes["server.address"] = host.strip("[]")
            if port.isdigit():
                attributes["server.port"] = int(port)
        if self.capture_content:
            # The messages: in the request itself, or in the body an HTTP client sends.
            body = call.request.get("body")
            messages = call.request.get("messages") or (
                body.get("messages") if isinstance(body, dict) else None
            )
            prompt = json.dumps(messages or [])
            attributes["gen_ai.prompt"] = redact(prompt)[:65536]
            if call.reply is not None:
                attributes["gen_ai.completion"] = redact(call.reply)[:65536]
        span = self.tracer.start_span(
            f"chat {call.model}",
            kind=SpanKind.CLIENT,
            start_time=int(call.started_at * 1e9),
            attributes=attributes,
        )
        if call.error:
            span.set_status(Status(StatusCode.ERROR, redact(str(call.error))[:1000]))
        span.end(end_time=int((call.started_at + call.latency_s) * 1e9))

    # -- across the fleet (a task hook) ---------------------------------------------------
    def serving(self, settings: Any) -> Callable[[], None]:
        return lambda: None

    def task_metadata(self) -> dict[str, str] | None:
        """The current span's context (the node sending the task), as W3C trace context."""
        if not trace.get_current_span().get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier or None

    @contextmanager
    def around_task(self, metadata: Any, info: TaskInfo) -> Iterator[Callable[[], Any]]:
        carrier = (
            {k: v for k, v in metadata.items() if isinstance(k, str) and isinstance(v, str)}
            if isinstance(metadata, dict)
            else {}
        )
        parent = _PROPAGATOR.extract(carrier)
        span = self.tracer.start_span(
            f"asyncgraph.task {info.function}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "asyncgraph.function": info.function,
                "asyncgraph.op": info.op,
                "asyncgraph.queue": info.queue,
                "asyncgraph.worker": info.worker,
                "asyncgraph.task_id": info.task_id,
                "asyncgraph.queued_s": info.queued_s,
                "asyncgraph.delivery": info.delivery,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            with observe_calls(self.on_call):
                yield lambda: None
        finally:
            otel_context.detach(token)
            span.end()

    def on_reply(self, metadata: Any) -> None:
        return None

    # -- the whole --------------------------------------------------------------------
    @contextmanager
    def observing(self) -> Iterator[None]:
        """The block in which passes, nodes and model calls of this task are traced."""
        with ExitStack() as stack:
            stack.enter_context(observe_passes(self.on_pass))
            stack.enter_context(observe_nodes(self.on_node))
            stack.enter_context(observe_calls(self.on_call))
            yield


def _record_error(span: Any, error: BaseException) -> None:
    """``span.record_exception`` and an error status, their texts redacted (an exception
    message may quote a URL with its password or a key the server echoed)."""
    message = redact(str(error))
    span.add_event(
        "exception",
        {
            "exception.type": type(error).__qualname__,
            "exception.message": message,
            "exception.stacktrace": redact("".join(traceback.format_exception(error))),
            "exception.escaped": False,
        },
    )
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {message}"))


def _system(endpoint: str) -> str:
    if "openai.com" in endpoint:
        return "openai"
    if endpoint.startswith("simulated") or not endpoint:
        return "asyncgraph.simulated"
    return "openai_compatible"


@contextmanager
def otel_tracing(
    tracer_provider: Any = None, *, capture_content: bool = False
) -> Iterator[OTelTracing]:
    """Trace the passes, nodes and model calls of the block, and send the trace context
    with remote tasks (see the module docstring)::

        with otel_tracing():
            await loss.backward(executor=redis_executor)
    """
    tracing = _installed(tracer_provider, capture_content)
    with tracing.observing():
        yield tracing


def _installed(tracer_provider: Any, capture_content: bool) -> OTelTracing:
    """The process's task hook for OpenTelemetry (installed once; a new provider replaces it)."""
    current = task_hooks().get(HOOK_NAME)
    if (
        isinstance(current, OTelTracing)
        and tracer_provider is None
        and current.capture_content == capture_content
    ):
        return current
    tracing = OTelTracing(tracer_provider, capture_content=capture_content)
    install_task_hook(tracing)
    return tracing


def setup_worker_from_env(environ: dict[str, str] | None = None) -> OTelTracing | None:
    """On a worker: export spans when the environment asks for it, else do nothing.

    OTLP over HTTP (``opentelemetry-exporter-otlp-proto-http``) to
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, batched,
    flushed at exit; ``OTEL_SERVICE_NAME`` (default ``asyncgraph-worker``) names the
    service. ``ASYNCGRAPH_OTEL=0`` turns it off.

    Example::

        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector:4318"
        tracing = setup_worker_from_env()     # an OTelTracing; None when nothing is asked for
    """
    env = os.environ if environ is None else environ
    wanted = env.get("ASYNCGRAPH_OTEL", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if wanted in ("0", "false", "no") or not (endpoint or wanted in ("1", "true", "yes")):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": env.get("OTEL_SERVICE_NAME", "asyncgraph-worker")}
        )
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    atexit.register(provider.shutdown)
    return _installed(provider, env.get("ASYNCGRAPH_OTEL_CAPTURE_CONTENT") == "1")
