"""Planning a backward pass: which nodes run, how many gradients each target waits for.

A pure function of the graph (``make_plan``): the engine asks it once per pass, before
anything runs, and keeps only its answer. No event loop, no executor, nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgraph._exceptions import GraphError

from ._graph import Edge, Node
from ._variable import Variable

__all__ = ["Plan", "make_plan"]

Target = Node | Variable


@dataclass
class Plan:
    """What a pass will do.

    ``pending``: per target, how many gradients it receives before it is complete.
    ``execute`` (None: every node reached): the nodes that must run because a captured
    gradient depends on them; ``receives``: the targets that gradients are delivered to
    then (captures and the nodes that run); ``capture_nodes``: the nodes whose output
    gradients are captured (``grad(outputs=...)`` of non-leaves).
    """

    pending: dict[Target, int]
    execute: set[Node] | None = None
    receives: set[Target] | None = None
    capture_nodes: set[Node] = field(default_factory=set)


def make_plan(
    roots: Sequence[tuple[Edge, Variable | None]],
    capture_leaves: Sequence[Variable] | None,
    capture_outputs: Sequence[tuple[Node, int]],
    since: int | None = None,
) -> Plan:
    """Plan a pass from ``roots``; ``GraphError`` if a node to run was already freed.

    ``capture_leaves`` None: every leaf reached accumulates; else only gradients reaching
    them and ``capture_outputs`` are computed (nodes leading nowhere useful never run).
    ``since``: GradManager's recording window; nodes made before it are not
    differentiated through (their gradients may still be captured).
    """

    def cut(node: Any) -> bool:
        return since is not None and node.seq[-1] < since

    deps: dict[Target, int] = {}
    nodes: list[Node] = []
    stack: list[Node] = []
    seen: set[Node] = set()
    for (target, _), _grad in roots:
        deps[target] = deps.get(target, 0) + 1
        if target.__class__ is Node and target not in seen and not cut(target):
            seen.add(target)
            stack.append(target)
    while stack:
        node = stack.pop()
        nodes.append(node)
        for edge in node.next_edges:
            if edge is None:
                continue
            target = edge[0]
            deps[target] = deps.get(target, 0) + 1
            if target.__class__ is Node and target not in seen and not cut(target):
                seen.add(target)
                stack.append(target)
    plan = Plan(deps)
    executing: Sequence[Node] | set[Node] = nodes
    if capture_leaves is not None:
        plan.capture_nodes = {node for node, _ in capture_outputs}
        wanted: set[Target] = set(capture_leaves) | plan.capture_nodes
        execute = nodes_leading_to(roots, deps, wanted, cut)
        plan.receives = wanted | execute
        plan.execute = execute
        executing = execute
    for node in executing:
        if node.freed:
            raise GraphError(
                f"Trying to backward through the graph a second time: the graph "
                f"through {node.describe()} was freed by an earlier backward. Specify "
                f"retain_graph=True on the first backward (or call backward once)."
            )
    return plan


def nodes_leading_to(
    roots: Sequence[tuple[Edge, Variable | None]],
    deps: dict[Target, int],
    wanted: set[Target],
    cut: Callable[[Any], bool],
) -> set[Node]:
    """Nodes with a path to a wanted target, found in reverse topological order.

    A ``cut`` node is a target (its gradient may be wanted) but never runs, so no
    path goes through it.
    """
    counts = dict(deps)
    order: list[Node] = []
    queue: list[Node] = []
    for (target, _), _grad in roots:
        counts[target] -= 1
        if counts[target] == 0 and target.__class__ is Node and not cut(target):
            queue.append(target)
    while queue:
        node = queue.pop()
        order.append(node)
        for edge in node.next_edges:
            if edge is None:
                continue
            target = edge[0]
            counts[target] -= 1
            if counts[target] == 0 and target.__class__ is Node and not cut(target):
                queue.append(target)
    execute: set[Node] = set()
    for node in reversed(order):
        for edge in node.next_edges:
            if edge is not None and (edge[0] in wanted or edge[0] in execute):
                execute.add(node)
                break
    return execute
