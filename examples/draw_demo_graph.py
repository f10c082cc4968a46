"""Draw the graph of one pass of the demo: its first batch, before or after backward.

Run: ``python examples/draw_demo_graph.py [--format mermaid|dot] [--before] [--svg PATH]``

It builds the demo job (``asyncgraph demo``: simulated model, offline), runs the forward
of the first batch of 8 questions and the backward from their 8 judge losses under
``asyncgraph.observe.trace_pass``, then prints ``draw_graph(*losses, timeline=...)``:
the 8 identical example subgraphs are drawn once, marked ``x8``, with the feedback that
reached each variable. ``--before`` draws the graph before the backward; ``--svg PATH``
(or ``.png``) renders it with Graphviz's ``dot`` when it is installed.
"""

from __future__ import annotations

import argparse

import anyio

from asyncgraph import backward, graph_order
from asyncgraph.jobs.demo import DEMO_MODEL, build_demo_job, make_demo_model
from asyncgraph.observe import GraphPicture, draw_graph, trace_pass
from asyncgraph.text import register_model, unregister_model


async def demo_pass(before: bool) -> GraphPicture:
    unregister_model(DEMO_MODEL)
    register_model(DEMO_MODEL, make_demo_model(0.0))
    job, _prompt = build_demo_job()
    evaluations = []
    for i, example in enumerate(job.batch(0)):
        with graph_order(i):
            evaluations.append(await job.forward(example))
    losses = [e.loss for e in evaluations]
    if before:
        return draw_graph(*losses)
    async with trace_pass() as timeline:
        await backward(losses)
    # Without durations (they vary from run to run), so the README's copy stays exact.
    return draw_graph(*losses, timeline=timeline, max_chars=56, times=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    parser.add_argument("--before", action="store_true", help="draw it before the backward")
    parser.add_argument("--svg", metavar="PATH", help="also render it (needs Graphviz's dot)")
    args = parser.parse_args()
    picture = anyio.run(demo_pass, args.before)
    print(picture.to_mermaid() if args.format == "mermaid" else picture.to_dot(), end="")
    if args.svg:
        picture.render(args.svg)


if __name__ == "__main__":
    main()
