"""``Module``: registration, traversal, state dicts, save/load, ``await module(...)``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy
import pytest

from asyncgraph import Module, Parameter, Variable
from asyncgraph._core._module import IncompatibleKeys


class Stage(Module):
    def __init__(self, prompt: str, role: str) -> None:
        super().__init__()
        self.prompt = Parameter(prompt, role=role)
        self.label = "not state"  # a plain attribute

    async def forward(self, text: str) -> str:
        return f"{self.prompt.data}: {text}"


class Program(Module):
    def __init__(self) -> None:
        super().__init__()
        self.intro = Parameter("Be brief.", role="intro")
        self.planner = Stage("Plan it.", "planner prompt")
        self.solver = Stage("Solve it.", "solver prompt")
        self.weight = Parameter(0.5, role="weight")
        self.critic = Stage("Check it.", "critic prompt")

    async def forward(self, text: str) -> str:
        plan = await self.planner(text)
        answer = await self.solver(plan)
        return str(await self.critic(answer))


def test_attributes_register_in_assignment_order_with_dotted_names() -> None:
    program = Program()
    names = [name for name, _ in program.named_parameters()]
    assert names == ["intro", "weight", "planner.prompt", "solver.prompt", "critic.prompt"]
    assert list(program.parameters()) == [p for _, p in program.named_parameters()]
    assert [name for name, _ in program.named_children()] == ["planner", "solver", "critic"]
    assert list(program.children()) == [program.planner, program.solver, program.critic]
    assert [name for name, _ in program.named_modules()] == ["", "planner", "solver", "critic"]
    assert next(iter(program.modules())) is program
    assert [name for name, _ in program.named_parameters(recurse=False)] == ["intro", "weight"]
    assert [name for name, _ in program.named_parameters(prefix="p")][:1] == ["p.intro"]
    assert program.planner.label == "not state"


def test_nested_modules_are_walked_depth_first() -> None:
    outer = Module()
    outer.first = Program()
    outer.second = Stage("x", "x")
    names = [name for name, _ in outer.named_modules()]
    assert names == [
        "", "first", "first.planner", "first.solver", "first.critic", "second",
    ]  # fmt: skip
    assert [n for n, _ in outer.named_parameters()][-1] == "second.prompt"


def test_a_shared_parameter_is_one_parameter_under_two_names_in_the_state() -> None:
    shared = Parameter("shared", role="shared prompt")
    program = Module()
    program.a = Stage("a", "a")
    program.b = Stage("b", "b")
    program.a.prompt = shared
    program.b.prompt = shared
    assert list(program.parameters()) == [shared]
    assert program.state_dict() == {"a.prompt": "shared", "b.prompt": "shared"}


def test_state_dict_is_json_data_that_round_trips() -> None:
    program = Program()
    program.weight.data = numpy.array([[1.0, 2.0], [3.0, 4.0]])
    state = program.state_dict()
    assert state == {
        "intro": "Be brief.",
        "weight": [[1.0, 2.0], [3.0, 4.0]],
        "planner.prompt": "Plan it.",
        "solver.prompt": "Solve it.",
        "critic.prompt": "Check it.",
    }
    assert json.loads(json.dumps(state)) == state

    other = Program()
    other.weight.data = numpy.zeros((2, 2))
    result = other.load_state_dict(json.loads(json.dumps(state)))
    assert result == IncompatibleKeys([], [])
    assert other.state_dict() == state
    assert isinstance(other.weight.data, numpy.ndarray) and other.weight.data.dtype == float


def test_state_dict_is_a_copy() -> None:
    module = Module()
    module.items = Parameter(["a", "b"], role="items")
    state = module.state_dict()
    state["items"].append("c")
    assert module.items.data == ["a", "b"]
    module.load_state_dict(state)
    state["items"].append("d")
    assert module.items.data == ["a", "b", "c"]


def test_strict_load_names_missing_and_unexpected_keys_and_changes_nothing() -> None:
    program = Program()
    state = program.state_dict()
    del state["solver.prompt"]
    state["judge.prompt"] = "Judge it."
    state["planner.prompt"] = "Changed."
    with pytest.raises(KeyError) as info:
        program.load_state_dict(state)
    message = str(info.value)
    assert "missing: ['solver.prompt']" in message and "unexpected: ['judge.prompt']" in message
    assert "strict=False" in message
    assert program.planner.prompt.data == "Plan it."


def test_non_strict_load_returns_missing_and_unexpected_keys() -> None:
    program = Program()
    state = program.state_dict()
    del state["solver.prompt"]
    state["judge.prompt"] = "Judge it."
    state["planner.prompt"] = "Changed."
    result = program.load_state_dict(state, strict=False)
    assert result.missing_keys == ["solver.prompt"]
    assert result.unexpected_keys == ["judge.prompt"]
    assert program.planner.prompt.data == "Changed."
    assert program.solver.prompt.data == "Solve it."


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("planner.prompt", 3, "a number, but the parameter holds a str"),
        ("weight", "heavy", "a str, but the parameter holds a number"),
        ("weight", [1.0], "a list, but the parameter holds a number"),
    ],
)
def test_a_value_that_does_not_fit_raises_and_changes_nothing(
    name: str, value: Any, why: str
) -> None:
    program = Program()
    state = program.state_dict()
    state["intro"] = "changed"
    state[name] = value
    for strict in (True, False):
        with pytest.raises(ValueError, match=f"cannot load '{name}'.*{why}"):
            program.load_state_dict(state, strict=strict)
    assert program.intro.data == "Be brief."


def test_an_array_of_another_shape_does_not_load() -> None:
    module = Module()
    module.w = Parameter(numpy.zeros(3), role="w")
    with pytest.raises(ValueError, match=r"shape \(2,\), not \(3,\)"):
        module.load_state_dict({"w": [1.0, 2.0]})


def test_save_and_load_a_file(tmp_path: Path) -> None:
    program = Program()
    program.solver.prompt.data = "Solve it step by step."
    path = tmp_path / "program.json"
    program.save(path)
    saved = json.loads(path.read_text())
    assert saved["format"] == "asyncgraph-module" and saved["version"] == 1
    assert saved["module"].endswith("Program")
    assert saved["state_dict"] == program.state_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["program.json"]  # no temporary left

    fresh = Program()
    assert fresh.load(path) == IncompatibleKeys([], [])
    assert fresh.state_dict() == program.state_dict()


def test_load_refuses_a_file_that_is_not_a_saved_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a saved Module"):
        Program().load(bad)
    bad.write_text(json.dumps({"intro": "x"}))
    with pytest.raises(ValueError, match=r"write it with module\.save"):
        Program().load(bad)
    bad.write_text(json.dumps({"format": "asyncgraph-module", "version": 9, "state_dict": {}}))
    with pytest.raises(ValueError, match="version 9"):
        Program().load(bad)


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000, "{" * 100_000, '{"a":' * 100_000, b"\xff\xfe not utf-8", ""],
    ids=["deep-lists", "deep-braces", "deep-maps", "not-utf8", "empty"],
)
def test_any_file_that_does_not_parse_is_a_value_error_naming_it(
    tmp_path: Path, content: str | bytes
) -> None:
    bad = tmp_path / "corrupt.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    program = Program()
    before = program.state_dict()
    with pytest.raises(ValueError, match=r"corrupt\.json.* is not a saved Module") as caught:
        program.load(bad)
    assert not isinstance(caught.value, RecursionError)
    assert program.state_dict() == before  # nothing loaded


def test_assigning_a_non_parameter_over_a_parameter_raises() -> None:
    program = Program()
    with pytest.raises(TypeError, match=r"set \.intro\.data"):
        program.intro = "new text"  # type: ignore[assignment]
    with pytest.raises(TypeError, match="holds a Module"):
        program.planner = 3  # type: ignore[assignment]
    program.intro = None  # type: ignore[assignment]
    assert program.intro is None
    assert "intro" not in program.state_dict()
    program.intro = Parameter("back", role="intro")
    assert next(iter(program.named_parameters()))[0] == "intro"


def test_reassigning_a_name_moves_it_between_registries() -> None:
    module = Module()
    module.part = Parameter("p", role="p")
    module.part = Stage("s", "s")
    assert module.state_dict() == {"part.prompt": "s"}
    del module.part
    assert module.state_dict() == {}
    with pytest.raises(AttributeError, match="no attribute 'part'"):
        _ = module.part


def test_registration_errors() -> None:
    class Early(Module):
        def __init__(self) -> None:
            self.p = Parameter("x")
            super().__init__()

    with pytest.raises(AttributeError, match=r"after calling super\(\).__init__\(\)"):
        Early()
    module = Module()
    with pytest.raises(KeyError, match=r"contain no '\.'"):
        module.register_parameter("a.b", Parameter("x"))
    with pytest.raises(KeyError, match="taken by an attribute"):
        module.register_parameter("forward", Parameter("x"))
    with pytest.raises(TypeError, match="must be a Parameter or None"):
        module.register_parameter("p", Variable("x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a Module or None"):
        module.register_module("m", "text")  # type: ignore[arg-type]


def test_zero_grad_clears_every_parameter() -> None:
    program = Program()
    for p in program.parameters():
        p.grad = Variable("feedback")
    program.zero_grad()
    assert all(p.grad is None for p in program.parameters())


def test_repr_shows_the_tree() -> None:
    text = repr(Program())
    assert text.startswith("Program(\n  (intro): Parameter('Be brief.'")
    assert "  (planner): Stage(\n    (prompt): Parameter('Plan it.'" in text
    assert repr(Module()) == "Module()"


@pytest.mark.anyio
async def test_await_module_runs_forward() -> None:
    program = Program()
    assert await program("x") == "Check it.: Solve it.: Plan it.: x"

    class Sync(Module):
        def forward(self, x: int) -> int:  # type: ignore[override]
            return x + 1

    assert await Sync()(1) == 2
    with pytest.raises(NotImplementedError, match="Module must define forward"):
        await Module()()


def test_a_parsed_file_with_a_value_nested_too_deeply_is_a_value_error(tmp_path: Path) -> None:
    program = Program()
    state = program.state_dict()
    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    name = next(iter(state))
    saved = tmp_path / "deep.json"
    payload = {"format": "asyncgraph-module", "version": 1, "state_dict": {**state, name: deep}}
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # so that json itself parses it
    try:
        saved.write_text(json.dumps(payload))
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match="nested too deeply"):
        program.load(saved)
    assert program.state_dict() == state


def test_clone_gives_fresh_parameters_and_shares_the_rest() -> None:
    """Module.clone: what ParetoSearch drafts on (it reached into _parameters before)."""
    from asyncgraph import Module, Parameter

    class Inner(Module):
        def __init__(self, shared: Parameter) -> None:
            super().__init__()
            self.p = shared
            self.settings = {"temperature": 0}

    class Outer(Module):
        def __init__(self) -> None:
            super().__init__()
            shared = Parameter("prompt", role="system prompt")
            self.a = Inner(shared)
            self.b = Inner(shared)  # one Parameter reached twice

    program = Outer()
    twin = program.clone()
    assert twin is not program and twin.a is not program.a
    assert twin.a.p is not program.a.p and twin.a.p is twin.b.p  # cloned once
    assert (twin.a.p.data, twin.a.p.role) == ("prompt", "system prompt")
    assert twin.a.settings is program.a.settings  # other attributes shared
    twin.a.p.data = "changed"
    assert program.a.p.data == "prompt"
