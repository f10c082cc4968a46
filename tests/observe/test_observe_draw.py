"""Pictures of the graph: DOT and Mermaid, before and after backward, grouped when large."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import BackwardError, Function, Parameter, Variable
from asyncgraph.observe import draw_graph, trace_pass
from asyncgraph.text import concat

from .observe_helpers import Critique

pytestmark = pytest.mark.anyio


def box_lines(mermaid: str) -> dict[str, str]:
    return dict(re.findall(r'^  (v\d+)\["(.*)"\]$', mermaid, re.MULTILINE))


async def test_before_and_after_backward_the_picture_shows_values_then_feedback() -> None:
    prompt = Parameter("Be brief.", role="system prompt")
    answer = Critique.apply(prompt)
    before = draw_graph(answer)
    assert [b.title for b in before.boxes] == ["Critique", "system prompt"]
    assert before.edges == [("v1", "v0", "system prompt")]
    mermaid = before.to_mermaid()
    assert mermaid.startswith("flowchart TD\n")
    assert "'BE BRIEF.'" in box_lines(mermaid)["v0"]  # the output value, from ctx.output
    assert "feedback" not in mermaid

    async with trace_pass() as timeline:
        await answer.backward()
    after = draw_graph(answer, timeline=timeline)
    function, leaf = after.boxes
    assert function.status == "ok"
    assert any(line.startswith("feedback: ") for line in function.lines)  # what it received
    assert any(re.fullmatch(r"backward \d+ ms", line) for line in function.lines)
    assert leaf.kind == "parameter"
    assert "feedback: 'be shorter'" in leaf.lines
    dot = after.to_dot()
    assert dot.startswith("digraph asyncgraph {") and dot.rstrip().endswith("}")
    assert 'v1 -> v0 [label="system prompt"];' in dot


async def test_200_nodes_of_identical_siblings_are_drawn_as_one_with_x_n() -> None:
    prompt = Parameter("Be brief.", role="system prompt")
    answers = [
        Critique.apply(Variable(f"answer {i}", role="answer", requires_grad=True))
        for i in range(100)
    ]
    judged = [Critique.apply(prompt) for _ in range(99)]
    loss = concat(*answers, *judged)
    picture = draw_graph(loss)
    assert picture.node_count == 200
    titles = [(b.title, b.count) for b in picture.boxes]
    assert titles == [
        ("Concat", 1),
        ("Critique", 100),
        ("answer", 100),  # one per Critique of the group
        ("Critique", 99),
        ("system prompt", 1),
    ]
    assert ("v3", "v0", "shouted answer x99") in picture.edges
    assert "Critique  x100" in picture.to_mermaid()
    assert "peripheries=2" in picture.to_dot()
    everything = draw_graph(loss, group=False, max_boxes=50)
    assert len(everything.boxes) == 51  # 50 and one saying how many more
    assert everything.boxes[-1].kind == "more"
    assert everything.boxes[-1].title == f"… {400 - 99 - 50} more boxes"


class Boom(Function):
    dispatch = "remote"

    @staticmethod
    def forward(ctx: Any, x: Variable) -> Any:
        return x.data

    @staticmethod
    async def backward(ctx: Any, g: Variable) -> Variable:
        await anyio.lowlevel.checkpoint()
        raise ValueError("judge unavailable")


async def test_failed_and_remote_nodes_are_marked() -> None:
    x = Parameter("draft", role="draft")
    out = Boom.apply(x)
    picture = draw_graph(out)
    assert picture.boxes[0].remote and "(remote)" in picture.to_mermaid()
    assert 'style="rounded,filled,dashed"' in picture.to_dot()
    with pytest.raises(BackwardError):
        async with trace_pass() as timeline:
            await out.backward()
    failed = draw_graph(out, timeline=timeline)
    assert failed.boxes[0].status == "failed"
    assert "ValueError: judge unavailable" in "\n".join(failed.boxes[0].lines)
    assert "class v0 failed;" in failed.to_mermaid()
    assert '"#b91c1c"' in failed.to_dot()


async def test_text_is_cut_and_escaped_for_both_formats() -> None:
    x = Parameter('say "hi" <b>|</b> \\ # ' + "x" * 200, role="tricky")
    out = Critique.apply(x)
    picture = draw_graph(out, max_chars=40)
    assert all(len(line) <= 40 for box in picture.boxes for line in box.lines)
    mermaid = picture.to_mermaid()
    leaf = box_lines(mermaid)["v1"]
    assert '"' not in leaf and "<b>" not in leaf and "|" not in leaf
    assert "#34;" in leaf and "#60;" in leaf and "#124;" in leaf
    assert '\\"hi\\"' in picture.to_dot()


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="at least one output"):
        draw_graph()
    with pytest.raises(TypeError, match="takes Variables"):
        draw_graph("loss")  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
@pytest.mark.slow
def test_render_writes_an_svg_through_dot(tmp_path: Path) -> None:
    x = Parameter("draft", role="draft")
    picture = draw_graph(Critique.apply(x))
    svg = picture.render(tmp_path / "graph.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and "Critique" in text
    png = picture.render(tmp_path / "graph.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TRACING = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "tracing.md"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "draw_demo_graph.py"


@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
@pytest.mark.slow
def test_the_docs_show_the_picture_of_the_demo_pass(fmt: str) -> None:
    block = re.search(
        rf"<!-- demo-graph-{fmt} -->\n```{fmt}\n(.*?)```\n<!-- /demo-graph-{fmt} -->",
        TRACING.read_text(),
        re.DOTALL,
    )
    assert block is not None
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--format", fmt],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == block.group(1)
    assert "DemoJudge  x8  (remote)" in done.stdout and "DemoAnswer  x8  (remote)" in done.stdout
    assert "feedback: [8] Add the instruction" in done.stdout  # what reached the prompt
