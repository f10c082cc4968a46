"""No package reaches into another package's private attributes.

``tests/test_layers.py`` and the import contracts see imports: no package imports another
one's underscore modules. An attribute is invisible to them: ``ctx._saved`` read in
``asyncgraph.distributed`` breaks the fleet the day the core renames it, with no contract
failing. So this walks every module of ``asyncgraph/`` and finds each ``obj._name``
(and ``getattr(obj, "_name")``, ``setattr``, ``hasattr``, ``delattr``) on anything but
``self``, ``cls`` or ``super()``. A package is a top-level subpackage of asyncgraph
(``_core``, ``distributed``, ``text``, ...) or a top-level module (``cli``,
``_exceptions``, ...). The access is the package's own when the package itself defines
``_name``: a function, class or method of that name, a name it assigns, an attribute it
sets on ``self`` or ``cls``, a keyword ``_name=`` it passes, an import alias or a module
of that name. Any other is a reach into another package (or a library), and fails, but
for the few in ``ALLOWED``.

The walk has no types: a name the reaching package also defines for itself passes (a
package's ``journal._read`` on its own journal looks the same as one on another
package's object with a ``_read``). Keep private names distinct enough to be caught.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncgraph"
# Private names of the standard library that are its documented interface, as written at
# the call site; nothing of another library (STYLE: a patch release may remove it).
ALLOWED = {
    "os._exit",  # exit at once, without cleanup: the documented way out of a child process
    "sys._getframe",  # the caller's frame, for the line a MustAwait warning points at
}
_BY_NAME = ("getattr", "setattr", "hasattr", "delattr")


def package_of(path: Path) -> str:
    """``_core``, ``distributed``, ... for a module in a subpackage; the module's own name
    (``cli``, ``_exceptions``) for one at the top."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own class reads its own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def defined_names(tree: ast.AST) -> set[str]:
    """The private names a module defines (see the module's docstring for what counts)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if _own(node.value):
                names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg is not None:
            names.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.update(alias.name.split("."))
                if alias.asname:
                    names.add(alias.asname)
            if isinstance(node, ast.ImportFrom) and node.module:
                names.update(node.module.split("."))
    return {name for name in names if _private(name)}


def accesses(tree: ast.AST) -> Iterable[tuple[int, str, str]]:
    """``(line, name, expression)`` of each private attribute read or written on an object
    that is not ``self``, ``cls`` or ``super()``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            yield node.lineno, node.attr, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _own(node.args[0])
        ):
            yield node.lineno, node.args[1].value, ast.unparse(node)


def reaches(sources: dict[Path, str]) -> list[str]:
    """Every access in ``sources`` (module path -> text) to a private name that the
    accessing package does not define itself, and that ``ALLOWED`` does not list."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        package = package_of(path)
        names = defined_names(tree)
        names.update(p for p in path.relative_to(PACKAGE).with_suffix("").parts if _private(p))
        for name in names:
            owners.setdefault(name, set()).add(package)
    bad = []
    for path, tree in sorted(trees.items()):
        package = package_of(path)
        for line, name, expression in sorted(accesses(tree)):
            if package in owners.get(name, ()) or expression in ALLOWED:
                continue
            where = ", ".join(sorted(owners.get(name, ()))) or "no package of asyncgraph"
            bad.append(
                f"{path.relative_to(ROOT)}:{line} [{package}] {expression} (defined in {where})"
            )
    return bad


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_package_reads_or_writes_another_packages_private_attributes() -> None:
    bad = reaches(_sources())
    assert bad == [], (
        "a package reaches into another's private attributes; give the owner a named "
        "interface (a method or property) and use it:\n" + "\n".join(bad)
    )


def test_the_checker_finds_a_reach_into_another_packages_private_attribute() -> None:
    # What a regression looks like: the fleet reading the core's ctx state by hand.
    sources = _sources()
    probe = PACKAGE / "distributed" / "_probe.py"
    sources[probe] = (
        "def state(ctx, fn, var):\n"
        "    ctx._function_name = fn.__name__\n"
        "    flag = getattr(var, '_requires_grad')\n"
        "    return ctx._saved, flag\n"
    )
    assert [r for r in reaches(sources) if "_probe.py" in r] == [
        "asyncgraph/distributed/_probe.py:2 [distributed] ctx._function_name (defined in _core)",
        "asyncgraph/distributed/_probe.py:3 [distributed] getattr(var, '_requires_grad') "
        "(defined in _core)",
        "asyncgraph/distributed/_probe.py:4 [distributed] ctx._saved (defined in _core)",
    ]


def test_a_package_may_use_its_own_private_names_and_the_allowed_ones() -> None:
    sources = _sources()
    sources[PACKAGE / "_core" / "_probe.py"] = (
        "import os, sys\n"
        "def f(ctx, other):\n"
        "    ctx._saved = other._saved\n"  # the core, on its own objects
        "    sys._getframe(1)\n"
        "    os._exit(1)\n"
    )
    sources[PACKAGE / "text" / "_probe.py"] = "import os\ndef f(x):\n    return x._private_thing\n"
    assert [r for r in reaches(sources) if "_probe.py" in r] == [
        "asyncgraph/text/_probe.py:3 [text] x._private_thing (defined in no package of asyncgraph)"
    ]
