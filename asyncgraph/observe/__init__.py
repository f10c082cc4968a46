"""See inside a pass: timelines, a log of model calls, pictures of the graph.

Layer: imports the core (``asyncgraph.observe_nodes``, ``current_node``) and
``asyncgraph.models`` (``observe_calls``); ``asyncgraph.jobs`` builds on it. Nothing
here runs unless asked: without a ``trace_pass`` / ``log_calls`` block the engine and
the models see no observer at all.

- ``trace_pass(path)``: a Chrome / Perfetto trace of the passes in the block, one row
  per concurrent lane, model calls nested in their nodes (``Timeline``);
- ``log_calls(path)``: one JSON line per model call (request, reply, tokens, latency,
  cached, retries, cost, node, trace), secrets kept out (``CallLog``);
- ``draw_graph(loss)``: the graph as Graphviz DOT / SVG / PNG or Mermaid, grouped so
  it stays readable at hundreds of nodes (``GraphPicture``);
- ``labels(step=3)``: what the calls and spans of the block belong to;
- ``asyncgraph.observe.otel.otel_tracing()`` (the ``otel`` extra, imported only when
  used): OpenTelemetry spans of passes, nodes, model calls and the remote
  tasks of a worker fleet, one trace across machines.
"""

from ._calllog import CallLog, call_record, log_calls, read_call_log
from ._context import labels
from ._draw import GraphPicture, draw_graph
from ._timeline import Span, Timeline, trace_pass

__all__ = [
    "CallLog",
    "GraphPicture",
    "Span",
    "Timeline",
    "call_record",
    "draw_graph",
    "labels",
    "log_calls",
    "read_call_log",
    "trace_pass",
]
