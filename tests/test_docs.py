"""The documentation site: its tutorials run as written, its CLI pages list every flag."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPET = re.compile(
    r"<!-- docs-test: (\S+) -->\n```python\n(.*?)```\n(?:\n(?:`python job.py` )?prints:\n\n```text\n(.*?)```)?",
    re.DOTALL,
)


def snippets() -> dict[str, tuple[str, str | None]]:
    found: dict[str, tuple[str, str | None]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for name, code, expected in SNIPPET.findall(page.read_text()):
            assert name not in found, f"snippet name {name!r} is used twice"
            found[name] = (code, expected or None)
    return found


def run(
    code: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})},
        check=False,
    )


# Run by their own tests below (they need a job file on disk, or workers and a Redis).
RUN_ELSEWHERE = {"fleet-functions", "fleet-client", "fleet-job"}


def test_every_python_block_of_every_page_runs_in_the_suite_or_says_it_is_a_fragment() -> None:
    untested = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"^```python\n", text, re.MULTILINE):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if not re.fullmatch(r"<!-- (docs-test: \S+|fragment: \S.*\S) -->", before):
                line = text[: match.start()].count("\n") + 1
                untested.append(f"docs/{page.relative_to(DOCS)}:{line}")
    assert untested == [], (
        "python blocks that no test runs; add <!-- docs-test: NAME --> (and its output "
        "after prints:) or <!-- fragment: why it cannot run -->"
    )
    assert sum(text.count("```python") for text in map(Path.read_text, DOCS.rglob("*.md"))) > 0


def test_every_shell_block_names_the_test_that_runs_it_or_says_it_is_a_fragment() -> None:
    tests = {path.name: path.read_text() for path in (ROOT / "tests").glob("test_*.py")}
    unchecked = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in re.finditer(r"^```bash\n", text, re.MULTILINE):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            named = re.fullmatch(r"<!-- tested-by: tests/(\S+)::(\w+)( .*)? -->", before)
            if named and f"def {named[2]}(" in tests.get(named[1], ""):
                continue
            if not re.fullmatch(r"<!-- fragment: \S.*\S -->", before):
                unchecked.append(
                    f"docs/{page.relative_to(DOCS)}:{text[: match.start()].count(chr(10)) + 1}"
                )
    assert unchecked == [], "add <!-- tested-by: tests/FILE::TEST --> or <!-- fragment: why -->"


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert {page for page in pages if f": {page}" not in nav} == set()


@pytest.mark.parametrize("name", sorted(set(snippets()) - RUN_ELSEWHERE))
@pytest.mark.slow
def test_a_page_snippet_runs_as_written(name: str, tmp_path: Path) -> None:
    code, expected = snippets()[name]
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    if expected is not None:
        assert done.stdout == expected
    assert "Warning" not in done.stderr, done.stderr


@pytest.mark.slow
def test_the_tutorial_job_runs_from_the_command_line_as_the_tutorial_says(tmp_path: Path) -> None:
    # "From the command line": the same file, run and evaluated by the CLI, which
    # imports it and calls build_job() (no main(): the model must be set at import).
    code, _ = snippets()["tutorial-job"]
    (tmp_path / "job.py").write_text(code)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "asyncgraph", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
            check=False,
        )

    # In the reader's order: `python job.py` first (its main() fills runs/even-odd), so the
    # CLI's run needs a folder of its own, or it stops on that run's checkpoint.
    done = subprocess.run(
        [sys.executable, "job.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    done = cli("run", "job.py", "--out", "runs/even-odd-cli")
    assert done.returncode == 0, done.stderr
    assert "finished after 4 step(s)" in done.stdout
    assert "prompt: Label the number. Even numbers are 'even'. Odd numbers are 'odd'." in (
        done.stdout
    )
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    done = cli("eval", "job.py", "--params", "runs/even-odd-cli/best.json")
    assert done.returncode == 0, done.stderr
    assert "score: 1.0000" in done.stdout


def test_the_fleet_tutorial_runs_against_real_workers(
    tmp_path: Path, redis_server_binary: None
) -> None:
    from asyncgraph.distributed import RedisServer, wait_for_workers

    functions, _ = snippets()["fleet-functions"]
    client, expected = snippets()["fleet-client"]
    (tmp_path / "myfunctions.py").write_text(functions)
    with RedisServer() as server:
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "ASYNCGRAPH_REDIS_URL": server.url}
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "asyncgraph", "worker", "--import", "myfunctions"),
                *("--processes", "2", "--concurrency", "64", "--log-level", "WARNING"),
            ],
            cwd=tmp_path,
            env=env,
        )
        try:
            wait_for_workers(server.url, "grads", 2, proc=worker)
            done = run(client, tmp_path, {"ASYNCGRAPH_REDIS_URL": server.url})
        finally:
            worker.terminate()
            worker.wait(30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


def test_the_job_tutorial_runs_on_a_fleet_of_real_workers(
    tmp_path: Path, redis_server_binary: None
) -> None:
    from asyncgraph.distributed import RedisServer, wait_for_workers

    code, _ = snippets()["fleet-job"]
    (tmp_path / "job.py").write_text(code)
    page = (DOCS / "tutorials" / "job-on-a-fleet.md").read_text()
    with RedisServer() as server:
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "asyncgraph", "worker", "--redis", server.url),
                *("--import", "asyncgraph.text", "--import", "job"),
                *("--processes", "2", "--concurrency", "64", "--log-level", "WARNING"),
            ],
            cwd=tmp_path,
            env=env,
        )
        try:
            wait_for_workers(server.url, "grads", 2, proc=worker)
            done = subprocess.run(
                [
                    *(sys.executable, "-m", "asyncgraph", "run", "job.py"),
                    *("--redis", server.url, "--out", "runs/even-odd", "--no-progress"),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
                env=env,
                check=False,
            )
        finally:
            worker.terminate()
            worker.wait(30)
    assert done.returncode == 0, done.stderr
    # The page's output, but the wall time: every other line as the page shows it.
    for line in done.stdout.splitlines()[1:]:
        assert line in page, line
    assert "finished after 4 step(s)" in done.stdout


CLI = ["demo", "run", "eval", "worker", "status", "ui"]


def cli_usage(command: str) -> str:
    """The usage lines ``asyncgraph COMMAND -h`` prints, at a fixed width."""
    from asyncgraph.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse wraps usage lines to the terminal's width
    try:
        return str(sub.choices[command].format_usage()).removeprefix("usage: ")
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


@pytest.mark.parametrize("command", CLI)
def test_each_command_page_shows_the_usage_the_command_prints(command: str) -> None:
    page = (DOCS / "cli" / f"{command}.md").read_text()
    shown = re.search(r"```text\n(asyncgraph " + command + r" .*?)```", page, re.DOTALL)
    assert shown is not None, f"docs/cli/{command}.md shows no usage block"
    assert " ".join(shown[1].split()) == " ".join(cli_usage(command).split()), (
        f"docs/cli/{command}.md's usage is stale: regenerate it from `asyncgraph {command} -h`"
    )


@pytest.mark.parametrize("command", CLI)
def test_each_command_has_a_page_listing_all_its_flags(command: str) -> None:
    from asyncgraph.cli import build_parser

    page = (DOCS / "cli" / f"{command}.md").read_text()
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[
        command
    ]
    for action in sub._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help" and action.help != "==SUPPRESS==":
                assert f"`{flag}" in page, f"docs/cli/{command}.md does not mention {flag}"


def _griffe_rst():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("griffe_rst", DOCS / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_griffe_extension_turns_rst_roles_and_literal_blocks_into_markdown() -> None:
    convert = _griffe_rst().rst_to_markdown
    assert convert("See :class:`~asyncgraph.Variable` and :func:`backward`.") == (
        "See `Variable` and `backward`."
    )
    assert convert(":meth:`a.B.c`, :exc:`E`, :attr:`x`, :mod:`m`, :data:`D`") == (
        "`a.B.c`, `E`, `x`, `m`, `D`"
    )
    text = "Run it.\n\nExample::\n\n    await loss.backward()\n    print(1)\n\nAfter."
    assert convert(text) == (
        "Run it.\n\nExample:\n\n```python\nawait loss.backward()\nprint(1)\n```\n\nAfter."
    )
    # Indented (a docstring's section), a text block that is not Python, a bare "::".
    assert convert("  Layout::\n\n      a -> b\n  next") == (
        "  Layout:\n\n  ```text\n  a -> b\n  ```\n\n  next"
    )
    assert convert("::\n\n    x = 1\n") == "```python\nx = 1\n```"


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)
            if value and (key, tag) in (("href", "a"), ("src", "img")):
                self.links.append(value)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


RAW_MARKUP = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`|Example::|__all__|``")


@pytest.mark.slow
def test_the_built_site_shows_no_raw_rst_markup_and_no_all(site: Path) -> None:
    found = {
        str(page.relative_to(site)): sorted(set(RAW_MARKUP.findall(page.read_text())))
        for page in site.rglob("*.html")
    }
    assert {page: marks for page, marks in found.items() if marks} == {}


@pytest.mark.slow
def test_the_built_site_publishes_pages_and_pictures_not_build_tools(site: Path) -> None:
    """docs/griffe_rst.py renders the reference; it was published at the site's root."""
    published = sorted(str(p.relative_to(site)) for p in site.rglob("*.py"))
    assert published == []


def test_the_home_pages_install_block_fits_a_narrow_column() -> None:
    """Its lines were cut off and scrolled sideways on the home page (about 60 characters
    fit beside the navigation at common widths)."""
    text = (DOCS / "index.md").read_text()
    block = text.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    too_long = [line for line in block.splitlines() if len(line) > 60]
    assert too_long == []


@pytest.mark.slow
def test_every_link_of_the_built_site_reaches_a_page_and_an_anchor(site: Path) -> None:
    # Offline: links to other hosts are not followed; every link inside the site must
    # name a file that was built and, with a #fragment, an id on that page.
    pages: dict[Path, _Page] = {}
    for path in site.rglob("*.html"):
        parsed = _Page()
        parsed.feed(path.read_text())
        pages[path.resolve()] = parsed
    broken = []
    for path, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("mailto:"):
                continue
            base = site if parts.path.startswith("/") else path.parent  # 404.html: absolute
            target = (base / unquote(parts.path).lstrip("/")).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    assert broken == []


def _public_packages(lists: tuple[str, ...] = ("PUBLIC",)) -> list[str]:
    # The packages a user imports, as tests/test_surface.py lists them (with "INNER":
    # the leaves and the fleet's insides too).
    source = (ROOT / "tests" / "test_surface.py").read_text()
    packages = []
    for name in lists:
        block = re.search(rf"^{name} = \[(.*?)\]", source, re.MULTILINE | re.DOTALL)
        assert block is not None, name
        packages += re.findall(r'"([\w.]+)"', block.group(1))
    return packages


def _assigned_docstring(module_name: str, name: str) -> str:
    # The string under ``name = ...`` (how a type alias, which has no __doc__ of its own,
    # is documented; griffe reads it so), following ``from ... import name`` to its home.
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None, module_name
    tree = ast.parse(Path(spec.origin).read_text())
    for statement, following in zip(tree.body, [*tree.body[1:], None], strict=True):
        if isinstance(statement, ast.ImportFrom) and name in [a.name for a in statement.names]:
            package = module_name if spec.origin.endswith("__init__.py") else spec.parent
            home = importlib.util.resolve_name(
                "." * statement.level + (statement.module or ""), package
            )
            return _assigned_docstring(home, name)
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                return inspect.cleandoc(str(following.value.value))
            return ""
    return ""


def _public_docstrings() -> dict[str, str]:
    # Each public name's docstring as the reference shows it: the object's own, or the
    # string under the assignment of a value that has none of its own (a type alias).
    import importlib

    docs = {}
    for package in _public_packages(("PUBLIC", "INNER")):
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isroutine(value) or hasattr(value, "__wrapped__"):
                docs[f"{package}.{name}"] = inspect.getdoc(value) or ""
            else:
                docs[f"{package}.{name}"] = _assigned_docstring(package, name)
    return docs


def _literal_blocks(doc: str) -> list[tuple[str, str]]:
    # (paragraph, block) for each paragraph ending in "::" ("Example::", "Blocks nest::"):
    # the indented block after it, dedented, which docs/griffe_rst.py renders fenced.
    lines = doc.split("\n")
    found = []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::") or line.strip().startswith((">>>", "```")):
            continue
        base = len(line) - len(line.lstrip())
        block = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= base:
                break
            block.append(following)
        body = [b for b in block if b.strip()]
        if body:
            cut = min(len(b) - len(b.lstrip()) for b in body)
            found.append((line.strip(), "\n".join(b[cut:] for b in block).strip("\n")))
    return found


def _syntax_error(code: str) -> str | None:
    # Examples run inside an implied ``async def``: top-level ``await`` is allowed.
    try:
        compile(code, "<example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as exc:
        return f"{exc.msg} (line {exc.lineno}): {exc.text!r}"
    return None


def _names_without_an_example() -> list[str]:
    # An example is a literal block of Python; a block of output ("prints::") is not one.
    return sorted(
        name
        for name, doc in _public_docstrings().items()
        if not any(_syntax_error(code) is None for _, code in _literal_blocks(doc))
    )


def test_every_public_name_has_a_docstring_with_an_example() -> None:
    # Issue #25: the API reference shows one example for each name a user imports
    # (and for the names of the leaves and the fleet's insides, INNER).
    assert _names_without_an_example() == []


def test_every_example_block_of_a_public_docstring_is_valid_python() -> None:
    # The examples use names the surrounding text gives (``loss``, ``model``), so they are
    # compiled, not run: a wrong indentation or a stray quote shows here, and the site
    # renders each of them as Python, not as text.
    broken = {
        f"{name}: {head}": error
        for name, doc in _public_docstrings().items()
        for head, code in _literal_blocks(doc)
        if head.startswith("Example") and (error := _syntax_error(code)) is not None
    }
    assert broken == {}


# The examples run as written, with the few names their text takes as given (``loss``,
# ``model``, ``prompt``, ...): offline, in-process and without changing the process's
# defaults. The others need a server (a provider, Redis, a worker fleet), a subprocess,
# or objects of a whole program (``job``, ``tgd``); they are compiled above.
RUN_AS_WRITTEN = [
    *("asyncgraph.AsyncGraphError", "asyncgraph.BackwardError", "asyncgraph.Executor"),
    *("asyncgraph.Function", "asyncgraph.FunctionCtx", "asyncgraph.GradManager"),
    *("asyncgraph.GradManagerGroup", "asyncgraph.GraphError", "asyncgraph.LocalExecutor"),
    *("asyncgraph.Module", "asyncgraph.Node", "asyncgraph.NodeEvent", "asyncgraph.Parameter"),
    *("asyncgraph.PassInfo", "asyncgraph.backward", "asyncgraph.current_node"),
    *("asyncgraph.enable_grad", "asyncgraph.grad", "asyncgraph.graph_order"),
    *("asyncgraph.is_grad_enabled", "asyncgraph.no_grad", "asyncgraph.observe_nodes"),
    *("asyncgraph.observe_passes", "asyncgraph.set_grad_enabled", "asyncgraph.use_executor"),
    "asyncgraph.once_differentiable",
    *("asyncgraph.models.BaseChatModel", "asyncgraph.models.ChatModel"),
    *("asyncgraph.models.Completion", "asyncgraph.models.DiskCache"),
    *("asyncgraph.models.LocalRateLimiter", "asyncgraph.models.MemoryCache"),
    *("asyncgraph.models.ModelCall", "asyncgraph.models.ModelConfigError"),
    *("asyncgraph.models.ModelError", "asyncgraph.models.Pricing", "asyncgraph.models.RateLimit"),
    *("asyncgraph.models.RateLimitWaitError", "asyncgraph.models.Retry"),
    *("asyncgraph.models.Secret", "asyncgraph.models.SimulatedModel", "asyncgraph.models.Usage"),
    *("asyncgraph.models.check_base_url", "asyncgraph.models.format_cost"),
    *("asyncgraph.models.observe_calls", "asyncgraph.text.DeterministicEvaluator"),
    *("asyncgraph.text.LLMOptions", "asyncgraph.text.StructuredOutputError"),
    *("asyncgraph.text.TextLoss", "asyncgraph.text.UnknownModelError"),
    *("asyncgraph.text.approx_tokens", "asyncgraph.text.chat_call", "asyncgraph.text.concat"),
    *("asyncgraph.text.current_models", "asyncgraph.text.describe"),
    *("asyncgraph.text.deterministic_evaluator", "asyncgraph.text.exact_match"),
    *("asyncgraph.text.feedback_defaults", "asyncgraph.text.feedback_entries"),
    *("asyncgraph.text.json_schema_of", "asyncgraph.text.llm_call"),
    *("asyncgraph.text.python_call", "asyncgraph.text.resolve_model"),
    *("asyncgraph.text.truncate_to_tokens", "asyncgraph.text.unregister_model"),
    *("asyncgraph.text.use_feedback_budget", "asyncgraph.optim.Optimizer"),
    *("asyncgraph.jobs.Evaluation", "asyncgraph.observe.CallLog", "asyncgraph.observe.Span"),
    *("asyncgraph.observe.Timeline", "asyncgraph.observe.call_record"),
    *("asyncgraph.observe.draw_graph", "asyncgraph.observe.log_calls"),
    *("asyncgraph.observe.read_call_log", "asyncgraph.observe.trace_pass"),
    *("asyncgraph.distributed.ConfigError", "asyncgraph.distributed.WorkerConfig"),
    *("asyncgraph.distributed.build_registry", "asyncgraph.resp.RedisConnectionLost"),
    *("asyncgraph.resp.parse_redis_url", "asyncgraph.resp.redact_url"),
    *("asyncgraph.taskhooks.TaskInfo", "asyncgraph.taskhooks.task_hooks"),
    *("asyncgraph.taskhooks.uninstall_task_hook", "asyncgraph.jobs.demo.DEMO_MODEL"),
    *("asyncgraph.jobs.demo.make_demo_model", "asyncgraph.distributed.Limits"),
]


def _given_names() -> dict[str, object]:
    # What the examples' text takes as given, made fresh for each example.
    import contextlib
    import dataclasses
    import functools
    import importlib
    import random
    import time
    import warnings

    import anyio

    from asyncgraph import Function, GradManager, Parameter, Variable
    from asyncgraph.models import SimulatedModel

    class Double(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return Variable(x.data * 2)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return Variable(grad.data * 2)

    class Square(Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x)
            return Variable(x.data * x.data)

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            (x,) = ctx.saved_variables
            return Variable(2 * x.data * grad.data)

    names: dict[str, object] = {}
    for package in _public_packages(("PUBLIC", "INNER")):
        module = importlib.import_module(package)
        names.update({name: getattr(module, name) for name in module.__all__})
    x, w, w1, w2 = (Parameter(3.0, role=role) for role in ("x", "w", "w1", "w2"))
    names.update(
        anyio=anyio,
        contextmanager=contextlib.contextmanager,
        dataclass=dataclasses.dataclass,
        functools=functools,
        os=os,
        random=random,
        sys=sys,
        time=time,
        warnings=warnings,
        Double=Double,
        Square=Square,
        x=x,
        w=w,
        w1=w1,
        w2=w2,
        gm1=GradManager().attach([w1]),
        gm2=GradManager().attach([w2]),
        y=Double.apply(w),
        loss=Double.apply(x),
        loss1=Double.apply(x),
        loss2=Square.apply(x),
        model=SimulatedModel(latency_s=0),
        messages=[{"role": "user", "content": "Hi"}],
        prompt=Parameter("Answer tersely.", role="system prompt"),
        question=Variable("What is 6 * 7?", role="question"),
        answer=Variable("Paris", role="answer", requires_grad=True),
    )
    return names


@pytest.mark.anyio
@pytest.mark.parametrize("name", RUN_AS_WRITTEN)
async def test_an_example_of_a_public_docstring_runs_as_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio

    monkeypatch.chdir(tmp_path)  # examples write program.json, calls.jsonl, pass.json ...
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")  # models are built, never called
    # The ModelConfigError example sets ASYNCGRAPH_MODEL_RPM: set first, so it is undone.
    monkeypatch.setenv("ASYNCGRAPH_MODEL_RPM", "600")
    monkeypatch.delenv("ASYNCGRAPH_MODEL_RPM")
    blocks = [
        code
        for _, code in _literal_blocks(_public_docstrings()[name])
        if _syntax_error(code) is None
    ]
    assert blocks, f"{name} has no example"
    for code in blocks:
        names = _given_names()
        source = "async def example():\n" + "".join(f"    {line}\n" for line in code.split("\n"))
        exec(compile(source, f"<example of {name}>", "exec"), names)
        # In a task of its own: what an example sets in its context (set_grad_enabled,
        # use_models ...) ends with it, as the examples' own async def would.
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(names["example"])  # type: ignore[arg-type]


# -- names written in the docs and docstrings exist (#36.8) ------------------------------

_FULL_NAME = re.compile(r"(?<![\w.`])`{1,2}(asyncgraph(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}")
_REPO_PATH = re.compile(
    r"`{1,2}((?:asyncgraph|tests|benchmarks|docs|deploy|workers|examples)/[\w./-]+"
    r"\.(?:py|md|yaml|yml|toml|json|js|css|html))`{1,2}"
)
_ROLE = re.compile(r":(?:class|func):`~?([A-Za-z_]\w*)`")
_CLASS_ATTR = re.compile(r"``([A-Z]\w+)\.([a-z_]\w*)(?:\(\))?``")
# Strings that look like names and are not: a tag, a span attribute, a placeholder.
_NOT_NAMES = frozenset({"asyncgraph.job", "asyncgraph.cancelled", "asyncgraph.text.X"})


def _written_files() -> list[Path]:
    return sorted([*ROOT.glob("asyncgraph/**/*.py"), *DOCS.glob("**/*.md"), ROOT / "README.md"])


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _classes_and_their_names() -> dict[str, set[str]]:
    """Each asyncgraph class's name -> the names it or a base of it defines or sets on
    self (what ``Class.attr`` in a docstring may name)."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in ROOT.glob("asyncgraph/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, []).extend(
                b.id for b in node.bases if isinstance(b, ast.Name)
            )
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(inner.name)
                elif isinstance(inner, ast.Name):
                    names.add(inner.id)
                elif isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name):
                    names.add(inner.attr)

    def closure(name: str, seen: set[str]) -> set[str]:
        found = set(own.get(name, ()))
        for base in bases.get(name, ()):
            if base not in seen:
                found |= closure(base, seen | {base})
        return found

    return {name: closure(name, {name}) for name in own}


def test_every_asyncgraph_name_and_path_written_in_docs_and_docstrings_exists() -> None:
    """``asyncgraph.x.y`` and ``asyncgraph/x.py`` in a page or a docstring name something
    that exists (names that no longer did were left behind by moves and renames)."""
    missing = []
    for path in _written_files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for name in sorted(set(_FULL_NAME.findall(text)) - _NOT_NAMES):
            if not _resolves(name):
                missing.append(f"{where}: {name}")
        for written in sorted(set(_REPO_PATH.findall(text))):
            if not (ROOT / written).exists():
                missing.append(f"{where}: {written}")
    assert missing == []


# A bare name in double backticks: a class (``Retry``) or a call (``run_job()``).
_BARE_NAME = re.compile(r"(?<![\w.`])``([A-Z][a-z]+[A-Z]?\w*|[a-z]\w*\(\))``")
# Names of other projects, and words that look like names, that a text may write bare.
_FOREIGN_NAMES = {
    "Authorization": "an HTTP header",
    "Bearer": "an HTTP authorization scheme",
    "Cookie": "an HTTP header",
    "NaN": "a float value",
    "BackwardHook": "PyTorch's hook class",
    "CloneBackward": "PyTorch's grad_fn name",
    "CopyBackwards": "PyTorch's grad_fn name",
    "ModelResponse": "LiteLLM's reply class",
    "RunFinishedError": "trio's error",
    "StringBasedFunction": "TextGrad's class",
    "build_job()": "the function a job file defines",
}


def _names_asyncgraph_defines() -> set[str]:
    import builtins

    defined = set(dir(builtins))
    for path in ROOT.glob("asyncgraph/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name):
                defined.add(node.id)
            elif isinstance(node, ast.Attribute):
                defined.add(node.attr)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.rpartition(".")[2])
    return defined


def test_a_bare_name_written_in_double_backticks_exists() -> None:
    """``Supervisor`` or ``prefix_key()`` written bare in a page or a docstring names a
    class, function or attribute asyncgraph defines (or a builtin); another project's
    name is on ``_FOREIGN_NAMES`` with what it is. Names left behind by renames fail."""
    defined = _names_asyncgraph_defines()
    missing = []
    for path in _written_files():
        for written in sorted(set(_BARE_NAME.findall(path.read_text()))):
            name = written.removesuffix("()")
            if name not in defined and written not in _FOREIGN_NAMES:
                missing.append(f"{path.relative_to(ROOT)}: {written}")
    assert missing == []


def test_a_packages_docstring_lists_only_names_the_package_exports() -> None:
    """A package's ``__init__`` is its interface: a :class: or :func: its docstring
    lists is one of its names (``PythonCallOptions`` was listed, never exported)."""
    import importlib

    missing = []
    for init in ROOT.glob("asyncgraph/**/__init__.py"):
        package = ".".join(init.parent.relative_to(ROOT).parts)
        module = importlib.import_module(package)
        for name in sorted(set(_ROLE.findall(module.__doc__ or ""))):
            if not hasattr(module, name):
                missing.append(f"{package}: {name}")
    assert missing == []


def test_a_class_attribute_named_in_a_docstring_exists() -> None:
    """``Tasks._run`` in a docstring names a method of an asyncgraph class or of a base
    of it (``Worker._run`` outlived its move to ``Tasks``)."""
    known = _classes_and_their_names()
    missing = []
    for path in ROOT.glob("asyncgraph/**/*.py"):
        for cls, attribute in sorted(set(_CLASS_ATTR.findall(path.read_text()))):
            if cls in known and attribute not in known[cls]:
                missing.append(f"{path.relative_to(ROOT)}: {cls}.{attribute}")
    assert missing == []


# Diary wording: the guides say what is (the design, the reason for a choice, the current
# figure with its date, load and command); how the project got there goes to CHANGELOG.md
# (#36, point 9). Each pattern is a phrase that narrates, with the removed passage it
# comes from; a use that does not narrate goes on the allow-list with its reason.
_DIARY = re.compile(
    "|".join(
        [
            # "the fourth session of 2026-11-25", "at the end of the session"
            r"\b(?:this|that|the|next|previous|earlier|first|second|third|fourth|fifth"
            r"|sixth|seventh|eighth) sessions?\b",
            r"\ba session of\b",
            # "Tried and not kept", "tried the one change ... and took it out again"
            r"\btried\b(?! again)",
            r"\breverted\b",
            # "Fixed in two commits", "two things these runs found and that are fixed"
            r"\bfixed in (?:one|two|three|\d+) commits?\b",
            r"\b(?:that|which) (?:are|were) (?:now )?fixed\b",
            # "(it was about 819 MB)", "(was 73 to 75)"
            r"\((?:it )?was (?:about )?\d",
            r"[;,] (?:it )?was (?:about )?\d",
            r"\bpreviously\b",
            r"\buntil now\b",
            r"\bwhat changed\b",
            r"\b(?:since|before|until) this (?:run|change|fix|session|cut)\b",
            r"\bbefore this day'?s\b",
            r"\b(?:the day before|days? ago|yesterday|this morning|this evening)\b",
            r"\bearlier (?:runs?|sessions?|tables?|figures?)\b",
            r"\b(?:our|earlier|previous) attempts?\b",
            # "The tree before #39 could not ...": an issue number as a point in time
            r"\b(?:since|before|until) (?:issue )?#\d+",
            r"\bnow \(#\d+\)",
            r"\(before: ",
            r"\bwent from [\d.]+",
            r"\bthe main branch\b",
            r"\bthe commit before\b",
        ]
    ),
    re.IGNORECASE,
)
# (page, the phrase as written) -> why it does not narrate the project's history.
_DIARY_ALLOWED: dict[tuple[str, str], str] = {}
_DIARY_PAGES = ("guide", "how-to", "tutorials", "reference", "cli", "coming-from")


def _prose(text: str) -> str:
    """A page without its fenced code blocks (a program's output may say anything)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def test_the_guides_carry_no_development_diary() -> None:
    pages = [ROOT / "README.md", *(p for d in _DIARY_PAGES for p in (DOCS / d).rglob("*.md"))]
    found, used = [], set()
    for page in sorted(pages):
        where = str(page.relative_to(ROOT))
        prose = _prose(page.read_text())
        for match in _DIARY.finditer(prose):
            key = (where, match[0])
            if key in _DIARY_ALLOWED:
                used.add(key)
                continue
            line = prose[: match.start()].count("\n") + 1
            found.append(f"{where}:{line}: {match[0]!r}")
    assert found == [], (
        "history in a guide: say what is (the design, the reason, the current figure with "
        "its date and load) and move the history to CHANGELOG.md"
    )
    assert set(_DIARY_ALLOWED) - used == set(), "allow-list entries that match nothing"
