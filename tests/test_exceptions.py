"""One exception tree: every error asyncgraph exports is an ``AsyncGraphError``, defined in
``asyncgraph._exceptions``, and the tree drawn at the top of that module (and on the docs
page) is the real class hierarchy."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import asyncgraph
import asyncgraph._exceptions as tree_module
from asyncgraph import AsyncGraphError, GradManager, GraphError, Variable

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncgraph"
DOCS_PAGE = ROOT / "docs" / "reference" / "errors.md"
# Raised and printed by the command line only (``asyncgraph run`` / ``eval``): no package
# exports it, since no user code can meet it.
NOT_EXPORTED = {"JobFileError"}
# Not an asyncgraph error: the distributed executor chains it to a RemoteError as the
# ``__cause__`` that carries a worker's traceback text (as concurrent.futures does).
PRIVATE_CAUSES = {"_RemoteTraceback"}
LINE = re.compile(r"^(?P<tree>[│├└─ ]*\w+(?: \(also [^)]*\))?)(?:\s{2,}(?P<text>\S.*))?$")


def public_modules() -> list[str]:
    """``asyncgraph`` and every module or package below it with no underscore in its path."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts[1:]):
            found.append(".".join(parts))
    return found


def exported_exceptions() -> list[tuple[str, str, type[BaseException]]]:
    """``(module, name, class)`` for every exception class in a public ``__all__``."""
    found = []
    for name in public_modules():
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                found.append((name, attr, obj))
    return found


def tree_classes() -> list[type[BaseException]]:
    """The classes defined in ``asyncgraph._exceptions``, in the order they are defined."""
    return [
        obj
        for obj in vars(tree_module).values()
        if isinstance(obj, type) and obj.__module__ == tree_module.__name__
    ]


def label(cls: type) -> str:
    extra = cls.__bases__[1:]
    also = f" (also {', '.join(b.__name__ for b in extra)})" if extra else ""
    return cls.__name__ + also


def draw_tree() -> list[str]:
    """The hierarchy drawn from the classes themselves: a class hangs under its first base,
    its other bases are written ``(also ...)``; children in the order they are defined."""
    classes = tree_classes()
    children: dict[type, list[type]] = {}
    for cls in classes:
        children.setdefault(cls.__bases__[0], []).append(cls)
    lines: list[str] = []

    def draw(parent: type, prefix: str) -> None:
        kids = children.get(parent, [])
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(prefix + ("└── " if last else "├── ") + label(kid))
            draw(kid, prefix + ("    " if last else "│   "))

    outside = [base for base in children if base not in classes]
    for base in outside:  # Exception (the root of our tree), then warning bases
        for root in children[base] if base is Exception else [base]:
            if lines:
                lines.append("")
            lines.append(label(root))
            draw(root, "")
    return lines


def docstring_block() -> list[str]:
    """The indented block after the first ``::`` of the module docstring, dedented."""
    doc = tree_module.__doc__
    assert doc is not None
    block: list[str] = []
    for line in doc.split("::\n\n", 1)[1].splitlines():
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    while block and not block[-1]:
        block.pop()
    return block


def structure(block: list[str]) -> list[str]:
    """The tree of a drawn block without its right-hand column of explanations."""
    out = []
    for line in block:
        if not line:
            out.append("")
            continue
        match = LINE.match(line)
        assert match, f"not a line of the tree: {line!r}"
        out.append(match["tree"])
    return out


def test_every_exported_exception_is_an_asyncgraph_error_defined_in_the_tree() -> None:
    exported = exported_exceptions()
    assert len(exported) > 20  # the walk found the packages
    for module, name, cls in exported:
        if issubclass(cls, Warning):
            continue
        assert issubclass(cls, AsyncGraphError), f"{module}.{name} is not an AsyncGraphError"
        assert cls.__module__ == "asyncgraph._exceptions", (
            f"{module}.{name} is defined in {cls.__module__}, not in the one tree"
        )


def test_every_class_of_the_tree_is_exported_by_some_package() -> None:
    exported = {cls for _, _, cls in exported_exceptions()}
    missing = {cls.__name__ for cls in tree_classes() if cls not in exported}
    assert missing == NOT_EXPORTED


def test_no_module_defines_an_exception_class_outside_the_tree() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "_exceptions.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in PRIVATE_CAUSES:
                bases = [ast.unparse(b) for b in node.bases]
                if any(re.search(r"(Error|Exception|Warning)$", b) for b in bases):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({bases})")
    assert found == [], "\n".join(found)


def test_the_tree_drawn_in_the_docstring_is_the_class_hierarchy() -> None:
    assert structure(docstring_block()) == draw_tree()


def test_every_error_in_the_drawn_tree_says_what_it_means() -> None:
    for line in docstring_block():
        match = LINE.match(line)
        if line and line != "UserWarning":
            assert match and match["text"], f"no explanation on {line!r}"


def test_the_docs_page_draws_the_same_tree() -> None:
    page = DOCS_PAGE.read_text()
    drawn = re.search(r"```text\n(.*?)```", page, re.DOTALL)
    assert drawn, "docs/reference/errors.md has no ```text block"
    assert drawn[1].rstrip("\n").splitlines() == docstring_block()
    assert "reference/errors.md" in (ROOT / "mkdocs.yml").read_text()


def test_the_docs_page_says_where_to_import_each_error_and_it_is_so() -> None:
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", DOCS_PAGE.read_text(), re.MULTILINE)
    assert sorted(name for name, _ in rows) == sorted(c.__name__ for c in tree_classes())
    for name, where in rows:
        cls = getattr(tree_module, name)
        modules = re.findall(r"`(asyncgraph[\w.]*)`", where)
        if name in NOT_EXPORTED:
            assert modules == [], name
            continue
        assert modules, f"{name}: no module to import it from"
        for module in modules:
            assert getattr(importlib.import_module(module), name) is cls, (name, module)


@pytest.mark.parametrize(
    ("module", "name", "base"),
    [
        ("asyncgraph", "GraphError", RuntimeError),
        ("asyncgraph", "BackwardError", RuntimeError),
        ("asyncgraph", "RemoteError", RuntimeError),
        ("asyncgraph", "RemoteConnectionError", ConnectionError),
        ("asyncgraph", "RemoteTimeoutError", TimeoutError),
        ("asyncgraph", "WireError", ValueError),
        ("asyncgraph.resp", "RedisConnectionLost", ConnectionError),
        ("asyncgraph.models", "ModelConfigError", ValueError),
        ("asyncgraph.text", "UnknownModelError", LookupError),
        ("asyncgraph.text", "StructuredOutputError", ValueError),
        ("asyncgraph.optim", "UpdateParseError", ValueError),
        ("asyncgraph.distributed", "ConfigError", ValueError),
        ("asyncgraph.distributed", "FleetError", RuntimeError),
    ],
)
def test_errors_keep_the_builtin_bases_existing_except_clauses_catch(
    module: str, name: str, base: type[BaseException]
) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, base) and issubclass(cls, AsyncGraphError)


def test_the_resp_errors_keep_their_behaviour() -> None:
    from asyncgraph.resp import ReplyError

    assert ReplyError("NOGROUP No such key").code == "NOGROUP"


def test_recording_twice_on_a_grad_manager_is_a_graph_error() -> None:
    gm = GradManager()
    gm.record()
    with pytest.raises(GraphError, match="already recording; call release"):
        gm.record()


@pytest.mark.anyio
async def test_grad_manager_backward_without_recording_is_a_graph_error() -> None:
    gm = GradManager().attach([Variable(1.0, requires_grad=True)])
    with pytest.raises(GraphError, match="no computation history"):
        await gm.backward()


def test_variable_misuse_is_a_graph_error_and_still_a_runtime_error() -> None:
    frozen = Variable(1.0)
    with pytest.raises(GraphError, match="does not require grad"):
        frozen.register_hook(lambda g: g)
    with pytest.raises(GraphError, match="does not require grad"):
        frozen.retain_grad()
    with pytest.raises(GraphError, match="does not require grad"):
        frozen.register_post_accumulate_grad_hook(lambda v, g: None)
    assert issubclass(GraphError, RuntimeError) and asyncgraph.GraphError is GraphError


@pytest.mark.parametrize(
    "error",
    [
        tree_module.RedisConnectionLost("Redis at 127.0.0.1:1 is unreachable"),
        tree_module.ReplyError("NOPERM this user has no permissions"),
        tree_module.ModelConfigError("OPENAI_API_KEY is not set", variable="k", value=""),
        tree_module.ConfigError("concurrency", "must be >= 1, got 0"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_the_command_line_prints_any_error_of_the_tree_as_one_line(
    error: AsyncGraphError, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncgraph.jobs._cli_common import EXIT_ERROR, run_command

    async def main() -> int:
        raise error

    assert run_command(main) == EXIT_ERROR
    assert capsys.readouterr().err == f"error: {error}\n"


def test_the_command_line_keeps_the_traceback_of_an_error_outside_the_tree() -> None:
    from asyncgraph.jobs._cli_common import run_command

    async def main() -> int:
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        run_command(main)
