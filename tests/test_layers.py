"""The layer map of docs/guide/architecture.md holds in the imports.

``lint-imports`` (import-linter, contracts in pyproject.toml) checks which package may
import which, in .ci/run. These tests check what it cannot say: that no package reaches
into another's underscore modules (but the shared leaves at the root: the exception tree
``asyncgraph._exceptions``, ``_redact``, ``_files`` and ``_values``), and that ``import
asyncgraph`` loads the core only.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncgraph"
HEAVY = ("httpx", "redis", "msgpack", "numpy", "rich")
# Private modules at the root that every package may import: leaves (they import nothing of
# asyncgraph), shared because the model clients and the RESP client cannot import the root
# (it loads the core). The exception tree: every error class is defined there, and each
# package imports the ones it raises. The one redaction of URLs and secrets, and the one way
# to write a private file.
SHARED_LEAVES = (
    "asyncgraph._exceptions",
    "asyncgraph._redact",
    "asyncgraph._files",
    "asyncgraph._values",
    "asyncgraph._install",
    "asyncgraph._lazy",
)


def owner(module: str) -> str:
    """The package a module belongs to: ``asyncgraph.<sub>``, or ``asyncgraph`` for the
    core (its private modules and ``asyncgraph._core``)."""
    parts = module.split(".")
    if len(parts) >= 2 and not parts[1].startswith("_"):
        return ".".join(parts[:2])
    return "asyncgraph"


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every module and name ``path`` imports, with its line: at module level, under
    ``if TYPE_CHECKING:`` and inside functions alike (``root`` holds the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    me = ".".join(parts)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def private_reaches(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    me = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    bad = []
    for line, target in imports_of(path):
        if not target.startswith("asyncgraph") or owner(target) == owner(me):
            continue
        if any(target == leaf or target.startswith(leaf + ".") for leaf in SHARED_LEAVES):
            continue
        rest = target[len(owner(target)) :].lstrip(".").split(".")
        if any(p.startswith("_") and not p.startswith("__") for p in rest if p):
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_no_package_imports_another_packages_underscore_modules() -> None:
    bad = [b for path in sorted(PACKAGE.rglob("*.py")) for b in private_reaches(path)]
    assert bad == [], "\n".join(bad)


def test_the_checker_finds_a_reach_into_a_private_module(tmp_path: Path) -> None:
    # The same walk over a file that does it: what a regression would look like.
    offender = PACKAGE / "optim" / "_layer_probe_tmp.py"
    offender.write_text("from asyncgraph.text._feedback import render_feedback\n")
    try:
        assert private_reaches(offender) == [
            "asyncgraph/optim/_layer_probe_tmp.py:1 imports asyncgraph.text._feedback",
            "asyncgraph/optim/_layer_probe_tmp.py:1 imports "
            "asyncgraph.text._feedback.render_feedback",
        ]
    finally:
        offender.unlink()


def test_every_package_may_import_the_exception_tree_and_nothing_else_private() -> None:
    offender = PACKAGE / "models" / "_layer_probe_tmp.py"
    offender.write_text(
        "from asyncgraph._exceptions import ModelError\n"
        "import asyncgraph._exceptions\n"
        "from asyncgraph._core._graph import Node\n"
    )
    try:
        assert private_reaches(offender) == [
            "asyncgraph/models/_layer_probe_tmp.py:3 imports asyncgraph._core._graph",
            "asyncgraph/models/_layer_probe_tmp.py:3 imports asyncgraph._core._graph.Node",
        ]
    finally:
        offender.unlink()


@pytest.mark.parametrize("leaf", SHARED_LEAVES)
def test_a_shared_leaf_imports_nothing_of_asyncgraph_but_another_leaf(leaf: str) -> None:
    # _files writes every file through _redact: the one private write is the one redaction.
    path = ROOT / (leaf.replace(".", "/") + ".py")
    found = [t for _, t in imports_of(path) if t.startswith("asyncgraph")]
    assert [t for t in found if not t.startswith(SHARED_LEAVES)] == []


def _loaded_by(imports: str) -> tuple[str, str]:
    """The heavy packages and the asyncgraph modules that ``import {imports}`` loads."""
    code = (
        f"import {imports}, sys; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r})); "
        "print(sorted(m for m in sys.modules if m.startswith('asyncgraph.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    heavy, ours = done.stdout.splitlines()
    return heavy, ours


@pytest.mark.slow
def test_import_asyncgraph_loads_the_core_only() -> None:
    heavy, ours = _loaded_by("asyncgraph")
    assert heavy == "[]"
    for name in ("distributed", "models", "text", "optim", "jobs", "observe", "resp", "cli"):
        assert f"'asyncgraph.{name}" not in ours, ours


@pytest.mark.slow
def test_import_asyncgraph_text_loads_no_http_or_redis_client() -> None:
    """Offline use (the simulated model) needs neither httpx nor the Redis client nor
    msgpack: they load when a model or fleet is first used (#35)."""
    heavy, ours = _loaded_by("asyncgraph.text, asyncgraph.optim")
    assert heavy == "[]"
    for name in ("distributed", "resp", "jobs"):
        assert f"'asyncgraph.{name}" not in ours, ours
    # A provider's client (and ssl with it) loads with the first model that names it.
    for name in ("_http", "_openai", "_anthropic", "_azure", "_litellm"):
        assert f"'asyncgraph.models.{name}'" not in ours, ours


@pytest.mark.slow
def test_a_text_step_on_the_simulated_model_loads_no_http_or_redis_client() -> None:
    """Not only the import: a whole offline step (the README's first example: a call, a
    judge, backward, a TGD update, on ``SimulatedModel``) loads neither httpx nor the Redis
    client nor msgpack, nor a provider's module (#35)."""
    code = "\n".join(
        [
            "import anyio, sys",
            "from asyncgraph import Parameter, Variable",
            "from asyncgraph.models import SimulatedModel",
            "from asyncgraph.optim import TGD",
            "from asyncgraph.text import TextLoss, llm_call, use_models",
            "async def main():",
            "    with use_models(SimulatedModel(latency_s=0.0)):",
            "        prompt = Parameter('Answer the question.', role='system prompt')",
            "        answer = await llm_call(prompt, Variable('What is 17 * 23?', role='question'))",
            "        loss = await TextLoss('Is the answer correct?')(answer)",
            "        await loss.backward()",
            "        await TGD([prompt]).step()",
            "    assert prompt.data != 'Answer the question.', prompt.data",
            "anyio.run(main)",
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}))",
            "print(sorted(m for m in sys.modules if m.startswith('asyncgraph.')))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    heavy, ours = done.stdout.splitlines()[-2:]
    assert heavy == "[]"
    for name in ("distributed", "resp", "jobs"):
        assert f"'asyncgraph.{name}" not in ours, ours
    for name in ("_http", "_openai", "_anthropic", "_azure", "_litellm"):
        assert f"'asyncgraph.models.{name}'" not in ours, ours


@pytest.mark.slow
def test_numpy_is_summed_once_it_is_used() -> None:
    code = (
        "import asyncgraph, sys; assert 'numpy' not in sys.modules; import numpy as np; "
        "from asyncgraph._core._accumulate import accumulate; "
        "print(accumulate(np.ones(2), np.ones(2)).tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[2.0, 2.0]"


@pytest.mark.slow
def test_a_new_module_dropped_into_the_core_is_held_by_the_contracts(tmp_path: Path) -> None:
    # The contracts name packages (asyncgraph._core), not modules: a module added to the
    # core tomorrow is checked without editing a list. On a copy, so that nothing is
    # written into the package a concurrent run imports.
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "asyncgraph", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = [
        sys.executable,
        "-c",
        "from importlinter.cli import lint_imports_command; lint_imports_command()",
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    clean = subprocess.run(lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    (tmp_path / "asyncgraph" / "_core" / "_probe.py").write_text(
        "from asyncgraph.distributed import RedisExecutor\n"
    )
    broken = subprocess.run(
        lint, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert broken.returncode != 0
    assert "asyncgraph._core._probe -> asyncgraph.distributed" in broken.stdout


# -- import cycles (#36, point 5) ---------------------------------------------------------


def import_graph(package_dir: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Which module of a package imports which other module of it. Every import statement
    counts: an import moved into a function or under ``TYPE_CHECKING`` to dodge a cycle
    is still an edge of that cycle."""
    package = ".".join(package_dir.relative_to(root).parts)
    modules = {
        package if path.name == "__init__.py" else f"{package}.{path.stem}": path
        for path in sorted(package_dir.glob("*.py"))
    }
    return {
        name: {target for _, target in imports_of(path, root) if target in modules} - {name}
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import one another in a circle: ``graph``'s strongly
    connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = {stack.pop()}
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                found.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found, key=sorted)


def test_the_resp_modules_import_one_another_without_a_cycle() -> None:
    assert circles(import_graph(PACKAGE / "resp")) == []


def test_the_cycle_finder_sees_an_import_hidden_in_a_function(tmp_path: Path) -> None:
    package = tmp_path / "probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("from probe._b import B\n")
    (package / "_b.py").write_text("B = 1\n\n\ndef f():\n    from ._a import A\n")
    (package / "_c.py").write_text("from probe import _a\n")
    graph = import_graph(package, tmp_path)
    assert circles(graph) == [{"probe._a", "probe._b"}]
    graph["probe._b"].clear()
    assert circles(graph) == []


# NOTE [Import circles of the core]: the core imports downwards (variables and the graph,
# Functions, executors, the engine, the entry points), but for two kinds of edge, kept:
# - Variable's methods that run what sits above it, as PyTorch's Tensor does: backward()
#   runs a pass (the engine works on Variables) and a + b applies the Add Function (whose
#   forward makes Variables). They import when called; their signature's types under
#   TYPE_CHECKING. These edges are listed, each with its method.
# - the graph's own three modules: a Variable's grad_fn is a Node, a Node records one
#   Function application and holds Variables, and Function.apply makes both. _graph names
#   the other two in annotations only (TYPE_CHECKING); they import it.
# Any other circle fails the test; so does a listed edge that is gone (take it off).
CORE_METHOD_EDGES = {
    ("_variable", "_autodiff"): "Variable.backward runs the pass",
    ("_variable", "_engine"): "Variable.backward's listeners= (Listener)",
    ("_variable", "_executor"): "Variable.backward's executor= (Executor)",
    ("_variable", "_arith"): "Variable.__add__ and __radd__ apply Add",
}
CORE_CIRCLES = [{"_function", "_graph", "_variable"}]


def test_the_cores_import_circles_are_only_the_ones_kept() -> None:
    graph = import_graph(PACKAGE / "_core")
    core = "asyncgraph._core."
    assert [edge for edge in CORE_METHOD_EDGES if core + edge[1] not in graph[core + edge[0]]] == []
    for source, target in CORE_METHOD_EDGES:
        graph[core + source].discard(core + target)
    assert circles(graph) == [{core + module for module in group} for group in CORE_CIRCLES]
