"""The graph as a picture: Graphviz DOT (SVG/PNG through ``dot``) and Mermaid.

``draw_graph(loss)`` walks the recorded graph from one or more outputs, before or
after backward, and draws it in the forward direction (inputs above, outputs below):

- a box per Function application: its name, the role and (shortened) value of its
  output, and after backward the feedback that output received; remote nodes
  (``dispatch = "remote"``) have a dashed border, failed ones are red, cancelled ones
  grey; with a ``Timeline`` of the pass, each says how long its backward took;
- a box per leaf: role, value, and its ``.grad`` (feedback) once there is one;
  Parameters are yellow;
- an arrow per differentiable input, labelled with the input's role; inputs that get
  no gradient are listed in the Function's box.

Readable at hundreds of nodes: identical sibling subgraphs (the same Functions, roles,
outcome and structure, e.g. one per example of a batch) are drawn once, marked
``x N`` (the first one's values shown); text is cut to ``max_chars``; past
``max_boxes`` boxes the rest is summarized in one box.

Values come from what the graph still holds: leaves and the outputs given, the
variables given in ``variables=``, saved variables (before a backward frees them) and
a text Function's ``ctx.output``. The feedback of an intermediate variable needs a
``Timeline`` of the pass (``trace_pass``) or ``retain_grad()``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asyncgraph import Node, Parameter, Variable

from ._timeline import Span, Timeline

Seq = tuple[int, ...]  # a node's order key (asyncgraph.Node.seq)

__all__ = ["GraphPicture", "PictureBox", "draw_graph"]

Vertex = Node | Variable


@dataclass
class PictureBox:
    """One box of a picture: a Function application (``kind="function"``) or a leaf."""

    id: str
    kind: Literal["function", "parameter", "leaf", "more"]
    title: str
    lines: list[str] = field(default_factory=list)
    count: int = 1
    remote: bool = False
    status: str = ""  # "", "ok", "failed", "cancelled", "not run"


@dataclass
class GraphPicture:
    """A drawn graph: ``boxes`` and ``edges`` (from input box to Function box, with the role).

    ``to_dot()`` / ``to_mermaid()`` give the text; ``render(path)`` writes SVG or PNG
    through Graphviz's ``dot`` (``RuntimeError`` saying how to install it when it is not
    on PATH).

    Example::

        picture = draw_graph(loss)            # a GraphPicture
        print(picture.to_mermaid())
        picture.render("graph.svg")           # needs Graphviz's dot on PATH
    """

    boxes: list[PictureBox]
    edges: list[tuple[str, str, str]]
    node_count: int = 0

    def to_dot(self) -> str:
        out = [
            "digraph asyncgraph {",
            '  graph [rankdir=TB, fontname="Helvetica", nodesep=0.3, ranksep=0.45];',
            '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
            '  edge [fontname="Helvetica", fontsize=9, color="#555555"];',
        ]
        for box in self.boxes:
            attrs = {"label": _dot_label(box), **_dot_style(box)}
            out.append(f"  {box.id} [{', '.join(f'{k}={v}' for k, v in attrs.items())}];")
        for src, dst, role in self.edges:
            label = f" [label={_dot_quote(role)}]" if role else ""
            out.append(f"  {src} -> {dst}{label};")
        out.append("}")
        return "\n".join(out) + "\n"

    def to_mermaid(self) -> str:
        out = ["flowchart TD"]
        for box in self.boxes:
            text = "<br/>".join(_mermaid_text(line) for line in [_title(box), *box.lines])
            out.append(f'  {box.id}["{text}"]')
        for src, dst, role in self.edges:
            arrow = f' -- "{_mermaid_text(role)}" --> ' if role else " --> "
            out.append(f"  {src}{arrow}{dst}")
        classes: dict[str, list[str]] = {}
        for box in self.boxes:
            classes.setdefault(_css_class(box), []).append(box.id)
        out.extend(
            [
                "  classDef fn fill:#dbeafe,stroke:#1e3a8a,color:#111111;",
                "  classDef remote fill:#dbeafe,stroke:#1e3a8a,stroke-dasharray:5 3,color:#111111;",
                "  classDef failed fill:#fecaca,stroke:#b91c1c,stroke-width:2px,color:#111111;",
                "  classDef cancelled fill:#e5e7eb,stroke:#6b7280,color:#374151;",
                "  classDef param fill:#fef3c7,stroke:#b45309,color:#111111;",
                "  classDef leaf fill:#ffffff,stroke:#6b7280,color:#111111;",
                "  classDef more fill:#f3f4f6,stroke:#9ca3af,stroke-dasharray:2 2,color:#374151;",
            ]
        )
        for name, ids in classes.items():
            out.append(f"  class {','.join(ids)} {name};")
        return "\n".join(out) + "\n"

    def render(self, path: str | Path, format: str | None = None) -> Path:
        """Write the picture as SVG or PNG (``format`` defaults to the file's suffix)."""
        target = Path(path)
        fmt = (format or target.suffix.lstrip(".") or "svg").lower()
        if fmt not in ("svg", "png", "pdf"):
            raise ValueError(f"render() writes svg, png or pdf, got format {fmt!r}")
        dot = shutil.which("dot")
        if dot is None:
            raise RuntimeError(
                "Graphviz's `dot` is not on PATH, so the picture cannot be rendered: install "
                "it (apt-get install graphviz, brew install graphviz), or write to_dot() / "
                "to_mermaid() to a file and render that elsewhere"
            )
        done = subprocess.run(
            [dot, f"-T{fmt}", "-o", str(target)],
            input=self.to_dot(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"dot failed to render {target}: {done.stderr.strip()}")
        return target


# -- building ---------------------------------------------------------------------


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _short(value: Any, max_chars: int) -> str:
    if isinstance(value, Variable):
        value = value.data
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        parts = [v for v in value if v.strip()]
        text = " | ".join(" ".join(v.split()) for v in parts) if parts else '""'
        if len(parts) > 1:
            text = f"[{len(parts)}] {text}"
    elif isinstance(value, str):
        text = repr(" ".join(value.split())) if value.strip() else '""'
    elif type(value).__module__ == "numpy" and hasattr(value, "shape"):
        text = f"array{tuple(value.shape)} {value.dtype}"
    else:
        text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class _Builder:
    def __init__(
        self,
        outputs: Sequence[Variable],
        variables: Sequence[Variable],
        timeline: Timeline | None,
        max_chars: int,
        max_boxes: int,
        group: bool,
        times: bool,
    ) -> None:
        self.outputs = outputs
        self.times = times
        self.max_chars = max_chars
        self.max_boxes = max_boxes
        self.group = group
        self.spans: dict[Seq, Span] = timeline.node_spans() if timeline is not None else {}
        self.values: dict[tuple[int, int], Variable] = {}
        for var in (*outputs, *variables):
            if var.grad_fn is not None:
                self.values[(id(var.grad_fn), var.output_nr)] = var
        self.parents: dict[int, int] = {}
        self.sigs: dict[int, Any] = {}
        self.ids: dict[int, str] = {}
        self.boxes: list[PictureBox] = []
        self.edges: list[tuple[str, str, str]] = []
        self.node_count = 0
        self.vertex_count = 0
        self.cut = False
        self.absorbed: set[int] = set()  # vertices a drawn "x N" group stands for

    # The graph from the outputs: every vertex once, in-degree counted per edge.
    def walk(self) -> list[Vertex]:
        roots: list[Vertex] = [v.grad_fn if v.grad_fn is not None else v for v in self.outputs]
        seen: dict[int, Vertex] = {}
        stack = list(reversed(roots))
        for root in roots:
            self.parents[id(root)] = self.parents.get(id(root), 0) + 1
        while stack:
            vertex = stack.pop()
            if id(vertex) in seen:
                continue
            seen[id(vertex)] = vertex
            if isinstance(vertex, Node):
                self.node_count += 1
                for child in self.children(vertex):
                    self.parents[id(child[0])] = self.parents.get(id(child[0]), 0) + 1
                    stack.append(child[0])
                # Values of upstream outputs that this node saved for its backward.
                saved = vertex.ctx.raw_saved or ()
                for var in saved:
                    if isinstance(var, Variable) and var.grad_fn is not None:
                        self.values.setdefault((id(var.grad_fn), var.output_nr), var)
        self.vertex_count = len(seen)
        return roots

    @staticmethod
    def children(node: Node) -> list[tuple[Vertex, str]]:
        out: list[tuple[Vertex, str]] = []
        for i, edge in enumerate(node.next_edges):
            if edge is not None:
                role = node.input_roles[i] if i < len(node.input_roles) else ""
                out.append((edge[0], role))
        return out

    def status(self, node: Node) -> str:
        span = self.spans.get(node.seq)
        if span is None:
            return "not run" if self.spans else ""
        return span.status

    # Structural signature: shared vertices (several parents) by identity, the rest by
    # what they are and what hangs below them, so identical sibling subgraphs compare equal.
    def sig(self, vertex: Vertex) -> Any:
        key = id(vertex)
        found = self.sigs.get(key)
        if found is not None:
            return found
        if self.parents.get(key, 0) > 1:
            result: Any = ("shared", key)
        elif isinstance(vertex, Node):
            result = (
                "node",
                vertex.name,
                vertex.input_roles,
                vertex.output_roles,
                self.status(vertex),
                tuple((self.sig(child), role) for child, role in self.children(vertex)),
            )
        else:
            result = ("leaf", type(vertex).__name__, vertex.role)
        self.sigs[key] = result
        return result

    def groups(self, vertices: Iterable[tuple[Vertex, str]]) -> list[tuple[Vertex, str, int]]:
        """Vertices with their role and how many identical siblings each stands for."""
        order: list[tuple[Vertex, str, int]] = []
        index: dict[Any, int] = {}
        for vertex, role in vertices:
            if not self.group or self.parents.get(id(vertex), 0) > 1:
                order.append((vertex, role, 1))
                continue
            key = (self.sig(vertex), role)
            at = index.get(key)
            if at is None:
                index[key] = len(order)
                order.append((vertex, role, 1))
            else:
                first, first_role, count = order[at]
                order[at] = (first, first_role, count + 1)
                self.absorb(vertex)
        return order

    def absorb(self, vertex: Vertex) -> None:
        """Mark a grouped sibling's own subgraph as drawn (by its group's first member)."""
        stack = [vertex]
        while stack:
            v = stack.pop()
            if id(v) in self.absorbed or (v is not vertex and self.parents.get(id(v), 0) > 1):
                continue
            self.absorbed.add(id(v))
            if isinstance(v, Node):
                stack.extend(child for child, _ in self.children(v))

    def build(self) -> GraphPicture:
        roots = self.walk()
        for vertex, _, count in self.groups((r, "") for r in roots):
            self.draw(vertex, count)
        if self.cut:
            hidden = self.vertex_count - len(self.ids.keys() | self.absorbed)
            more = PictureBox(
                f"v{len(self.boxes)}",
                "more",
                f"… {hidden} more boxes",
                [f"over max_boxes={self.max_boxes}; pass a larger max_boxes to see them"],
            )
            self.boxes.append(more)
        return GraphPicture(self.boxes, self.edges, self.node_count)

    def draw(self, vertex: Vertex, count: int) -> str | None:
        """Draw ``vertex`` (and what it depends on) once; its box id, None if cut."""
        key = id(vertex)
        if key in self.ids:
            return self.ids[key]
        if len(self.boxes) >= self.max_boxes:
            self.cut = True
            return None
        box_id = f"v{len(self.boxes)}"
        self.ids[key] = box_id
        if isinstance(vertex, Node):
            box = self.function_box(box_id, vertex, count)
            self.boxes.append(box)
            for child, role, n in self.groups(self.children(vertex)):
                # A child of a box standing for N identical subgraphs stands for N too,
                # unless the N share it (then it is one box with N arrows into the group).
                shared = self.parents.get(id(child), 0) > 1
                child_id = self.draw(child, n if shared else n * count)
                if child_id is not None:
                    label = role if n == 1 else f"{role} x{n}" if role else f"x{n}"
                    self.edges.append((child_id, box_id, label))
        else:
            self.boxes.append(self.leaf_box(box_id, vertex, count))
        return box_id

    def function_box(self, box_id: str, node: Node, count: int) -> PictureBox:
        lines: list[str] = []
        for nr in range(max(1, node.num_outputs)):
            role = node.output_roles[nr] if nr < len(node.output_roles) else ""
            value = self.output_value(node, nr)
            if role or value is not None:
                lines.append(_cut(f"→ {role or 'output'}", self.max_chars))
            if value is not None:
                lines.append(self.line("= ", value))
            grad = self.output_feedback(node, nr)
            if grad is not None:
                lines.append(self.line("feedback: ", grad))
        constants = [
            role
            for role, edge in zip(node.input_roles, node.next_edges, strict=False)
            if edge is None
        ]
        named = [role for role in constants if role]
        if constants:
            unnamed = len(constants) - len(named)
            more = (
                f" (+{unnamed} unnamed)"
                if unnamed and named
                else f"{unnamed} unnamed"
                if unnamed
                else ""
            )
            lines.append(_cut(f"no grad: {', '.join(named)}{more}", self.max_chars))
        span = self.spans.get(node.seq)
        status = self.status(node)
        if span is not None and span.end_s is not None and self.times:
            took = f"backward {(span.end_s - span.start_s) * 1000:.0f} ms"
            lines.append(took if status == "ok" else f"{took}, {status}")
            if "error" in span.args:
                lines.append(_cut(str(span.args["error"]), self.max_chars))
        elif status and status != "ok":
            lines.append(status)
        remote = getattr(node.function, "dispatch", "local") == "remote"
        title = _cut(node.name, self.max_chars)
        return PictureBox(box_id, "function", title, lines, count, remote, status)

    def line(self, prefix: str, value: Any) -> str:
        return prefix + _short(value, max(8, self.max_chars - len(prefix)))

    def output_value(self, node: Node, nr: int) -> Any:
        var = self.values.get((id(node), nr))
        if var is not None:
            return var.data
        if node.num_outputs == 1:
            output = getattr(node.ctx, "output", None)  # the text Functions keep their answer
            if isinstance(output, str):
                return output
        return None

    def output_feedback(self, node: Node, nr: int) -> Any:
        span = self.spans.get(node.seq)
        if span is not None and nr < len(span.grads) and span.grads[nr] is not None:
            return span.grads[nr]
        if node.retained:
            ref = node.retained.get(nr)
            var = ref() if ref is not None else None
            if var is not None and var.grad is not None:
                return var.grad
        return None

    def leaf_box(self, box_id: str, leaf: Variable, count: int) -> PictureBox:
        kind: Literal["parameter", "leaf"] = "parameter" if isinstance(leaf, Parameter) else "leaf"
        lines = [self.line("= ", leaf.data)]
        if leaf.grad is not None:
            lines.append(self.line("feedback: ", leaf.grad))
        title = _cut(
            leaf.role or ("parameter" if kind == "parameter" else "variable"), self.max_chars
        )
        return PictureBox(box_id, kind, title, lines, count)


def draw_graph(
    *outputs: Variable,
    variables: Sequence[Variable] = (),
    timeline: Timeline | None = None,
    max_chars: int = 60,
    max_boxes: int = 300,
    group: bool = True,
    times: bool = True,
) -> GraphPicture:
    """Draw the graph that leads to ``outputs`` (see the module docstring).

    ``variables``: intermediate Variables whose values to show where they sit.
    ``timeline``: a ``Timeline`` of the pass (``trace_pass``) for each node's outcome,
    duration and the feedback its outputs received (``times=False`` leaves the durations
    out). ``group=False`` draws every node (no ``x N``). Raises ``TypeError`` when an output is not a Variable, ``ValueError``
    when none is given::

        async with trace_pass() as timeline:
            await loss.backward()
        print(draw_graph(loss, timeline=timeline).to_mermaid())
    """
    if not outputs:
        raise ValueError("draw_graph needs at least one output Variable (e.g. the loss)")
    for i, out in enumerate((*outputs, *variables)):
        if not isinstance(out, Variable):
            raise TypeError(f"draw_graph takes Variables; argument {i} is {out!r:.60}")
    if max_chars < 20 or max_boxes < 1:
        raise ValueError(
            f"max_chars must be >= 20 and max_boxes >= 1, got {max_chars} and {max_boxes}"
        )
    return _Builder(
        list(outputs), list(variables), timeline, max_chars, max_boxes, group, times
    ).build()


# -- text -----------------------------------------------------------------------------


def _title(box: PictureBox) -> str:
    title = box.title
    if box.count > 1:
        title += f"  x{box.count}"
    if box.remote:
        title += "  (remote)"
    return title


def _css_class(box: PictureBox) -> str:
    if box.kind == "function":
        if box.status == "failed":
            return "failed"
        if box.status in ("cancelled", "not run"):
            return "cancelled"
        return "remote" if box.remote else "fn"
    return {"parameter": "param", "leaf": "leaf", "more": "more"}[box.kind]


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def _dot_label(box: PictureBox) -> str:
    lines = [_title(box), *box.lines]
    escaped = [line.replace("\\", "\\\\").replace('"', '\\"') for line in lines]
    return '"' + "\\n".join(escaped) + '"'


_DOT_STYLES = {
    "fn": {"fillcolor": '"#dbeafe"', "color": '"#1e3a8a"'},
    "remote": {"fillcolor": '"#dbeafe"', "color": '"#1e3a8a"', "style": '"rounded,filled,dashed"'},
    "failed": {"fillcolor": '"#fecaca"', "color": '"#b91c1c"', "penwidth": "2"},
    "cancelled": {"fillcolor": '"#e5e7eb"', "color": '"#6b7280"'},
    "param": {"fillcolor": '"#fef3c7"', "color": '"#b45309"'},
    "leaf": {"fillcolor": '"#ffffff"', "color": '"#6b7280"'},
    "more": {"fillcolor": '"#f3f4f6"', "color": '"#9ca3af"', "style": '"rounded,filled,dotted"'},
}


def _dot_style(box: PictureBox) -> dict[str, str]:
    style = dict(_DOT_STYLES[_css_class(box)])
    if box.count > 1:
        style["peripheries"] = "2"  # a stack of identical boxes
    return style


def _mermaid_text(text: str) -> str:
    # Mermaid's entity codes (numeric): '#' first, so the codes themselves survive.
    for char in '#&"<>|':
        text = text.replace(char, f"#{ord(char)};")
    return text
