"""A griffe extension: the reStructuredText left in asyncgraph's docstrings, as Markdown.

The docstrings are read in terminals and editors too, where ``:class:`Variable``` and
``Example::`` read well; the site renders Markdown. Rather than rewrite every docstring,
mkdocstrings runs this extension (mkdocs.yml, ``extensions:``) on each object griffe
loads, and the API reference shows code and fenced examples instead of raw markup:

- ``:class:`X```, ``:func:``, ``:meth:``, ``:attr:``, ``:mod:``, ``:data:``, ``:exc:``,
  ``:obj:`` become the code span ``X`` (``~a.b.X``: ``X``, as Sphinx shows it);
- a paragraph ending in ``::`` (``Example::``, ``Use it like this::``) ends in ``:`` and
  the indented block after it becomes a fenced ``python`` block (``text`` when the block
  does not parse as Python).

tests/test_docs.py builds the site and checks that none of the markup is left.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group(1)
    shown = target.rsplit(".", 1)[-1] if match.group(0).count("`~") else target
    return f"`{shown}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(code: str) -> str:
    # Examples use top-level ``await`` (they run inside ``async def``): parse them so.
    try:
        compile(code, "<example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError:
        return "text"
    return "python"


def rst_to_markdown(text: str) -> str:
    """Return ``text`` with the roles as code spans and ``::`` blocks fenced."""
    text = ROLE.sub(_role, text)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.rstrip().endswith("::") or line.strip().startswith((">>>", "```")):
            out.append(line)
            continue
        base = _indent(line)
        head = line.strip()[:-2].rstrip()
        block: list[str] = []
        j = i
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        body = [b for b in block if b.strip()]
        if not body:
            out.append(line)
            continue
        cut = min(_indent(b) for b in body)
        code = "\n".join(b[cut:] if b.strip() else "" for b in block).strip("\n")
        pad = " " * base
        if head:
            out.extend([f"{pad}{head}:", ""])
        out.append(f"{pad}```{_language(code)}")
        out.extend(f"{pad}{c}" if c else "" for c in code.split("\n"))
        out.append(f"{pad}```")
        if j < len(lines) and lines[j].strip():
            out.append("")
        i = j
    return "\n".join(out)


class RstToMarkdown(Extension):
    """Rewrite each loaded object's docstring with :func:`rst_to_markdown`."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
