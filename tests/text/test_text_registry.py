from __future__ import annotations

import pytest

from asyncgraph.models import SimulatedModel
from asyncgraph.text import (
    UnknownModelError,
    register_model,
    resolve_model,
    unregister_model,
)
from asyncgraph.text._registry import model_ref


def test_registered_name_resolves_to_the_instance(registered: list[str]) -> None:
    model = SimulatedModel(latency_s=0.0)
    registered.append(register_model("tests-registry-judge", model))
    assert resolve_model("tests-registry-judge") is model
    assert resolve_model("tests-registry-judge", base_url="http://ignored") is model


def test_spec_builds_a_model_once_per_process() -> None:
    model = resolve_model("simulated:0")
    try:
        assert isinstance(model, SimulatedModel)
        assert model.latency_s == 0.0
        assert resolve_model("simulated:0") is model
    finally:
        assert unregister_model("simulated:0") is model
    assert resolve_model("simulated:0") is not model
    unregister_model("simulated:0")


def test_unknown_spec_raises_a_clear_error() -> None:
    with pytest.raises(UnknownModelError, match=r"register_model\('no-such-model'") as info:
        resolve_model("no-such-model")
    assert info.value.spec == "no-such-model"
    assert isinstance(info.value, LookupError)


def test_instance_gets_one_generated_name_that_only_this_process_knows() -> None:
    model = SimulatedModel(latency_s=0.0)
    ref = model_ref(model)
    try:
        assert ref == model_ref(model)  # same instance, same name
        assert ref["spec"].startswith("instance:SimulatedModel:")
        assert resolve_model(ref["spec"]) is model
    finally:
        unregister_model(ref["spec"])
    with pytest.raises(UnknownModelError, match="instances cannot travel between processes"):
        resolve_model(ref["spec"])


def test_base_url_goes_with_a_spec_not_an_instance() -> None:
    with pytest.raises(ValueError, match="base_url"):
        model_ref(SimulatedModel(latency_s=0.0), "http://localhost:1/v1")
    assert model_ref("openai:m", "http://h/v1") == {"spec": "openai:m", "base_url": "http://h/v1"}


def test_register_rejects_non_models() -> None:
    with pytest.raises(TypeError, match="ChatModel"):
        register_model("x", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        register_model(" ", SimulatedModel())
