"""``reachable_models``: the models a job can reach, found without running it (what a
cost cap checks for prices at the job's start)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from asyncgraph import Module, Parameter, Variable
from asyncgraph.jobs._reachable import reachable_models
from asyncgraph.models import SimulatedModel
from asyncgraph.optim import SGD, TGD
from asyncgraph.text import TextLoss, llm_call, register_model, unregister_model, use_models

NAMES = ("reach-a", "reach-b", "reach-c", "reach-d", "reach-e", "reach-f")
JUDGE_MODEL = "reach-a"  # a global whose name says model


@pytest.fixture
def models() -> Iterator[dict[str, SimulatedModel]]:
    made = {name: SimulatedModel() for name in NAMES}
    for name, model in made.items():
        register_model(name, model)
    yield made
    for name in made:
        unregister_model(name)


class Settings:
    """An object the forward refers to: searched one level (its attributes)."""

    def __init__(self) -> None:
        self.feedback_model = "reach-b"
        self.deeper = Settings2()


class Settings2:
    def __init__(self) -> None:
        self.model = "reach-f"  # two levels away from the forward: not searched


SETTINGS = Settings()


class Program(Module):
    def __init__(self) -> None:
        super().__init__()
        self.prompt = Parameter("Answer.", role="prompt")
        self.judge = Judge()

    async def forward(self, example: Mapping[str, Any]) -> Any:
        return None


class Judge(Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss = TextLoss("Grade it.", model="reach-d")  # an object in a submodule


def found(models: dict[str, SimulatedModel], reached: list[Any]) -> dict[str, str]:
    by_id = {id(model): name for name, model in models.items()}
    return {by_id[id(r.model)]: r.where for r in reached if id(r.model) in by_id}


def test_globals_nonlocals_keywords_objects_and_modules_are_searched(
    models: dict[str, SimulatedModel],
) -> None:
    prompt = Parameter("Answer.", role="prompt")
    instance = models["reach-c"]
    program = Program()

    async def forward(example: Mapping[str, Any]) -> Any:
        question = Variable(example["q"], role="question")
        answer = await llm_call(prompt, question, model=JUDGE_MODEL)
        feedback = SETTINGS.feedback_model
        return await llm_call(prompt, answer, model="reach-e", feedback_model=feedback), instance

    reached = reachable_models(SGD([prompt], lr=0.1), program, forward)
    assert found(models, reached) == {
        "reach-a": "forward's global JUDGE_MODEL",
        "reach-b": "forward's global SETTINGS.feedback_model",
        "reach-c": "forward's variable instance",
        "reach-d": "parameters.judge.loss.model",
        "reach-e": "forward's model= argument",
    }  # reach-f is two objects away


def test_the_optimizer_a_bound_forward_and_the_default_models(
    models: dict[str, SimulatedModel],
) -> None:
    program = Program()
    optimizer = TGD(program.parameters(), model="reach-a")
    with use_models(model="reach-b", feedback_model=models["reach-c"]):
        reached = reachable_models(optimizer, program, program.forward)
    assert found(models, reached) == {
        "reach-a": "optimizer.model",
        "reach-b": "the default model",
        "reach-c": "the default feedback model",
        "reach-d": "parameters.judge.loss.model",
    }


def test_names_that_do_not_resolve_and_strings_not_named_model_are_left_alone(
    models: dict[str, SimulatedModel],
) -> None:
    prompt = Parameter("Answer.", role="prompt")
    greeting = "reach-a"  # a str, but not under a model's name

    async def forward(example: Mapping[str, Any]) -> Any:
        await llm_call(prompt, greeting, model="no-such-model-anywhere")
        return await llm_call(prompt, greeting, model="reach-" + "b")  # computed: not seen

    assert found(models, reachable_models(SGD([prompt], lr=0.1), [prompt], forward)) == {}
