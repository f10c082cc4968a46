from __future__ import annotations

import gc

import pytest

from asyncgraph.models import ModelConfigError, SimulatedModel
from asyncgraph.text import UnknownModelError, register_model, resolve_model, unregister_model
from asyncgraph.text._registry import ModelRef, model_ref


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
        assert ref.spec.startswith("instance:SimulatedModel:")
        assert not ref.portable
        assert resolve_model(ref.spec) is model and ref.resolve() is model
    finally:
        assert unregister_model(ref.spec) is model
    with pytest.raises(UnknownModelError, match="model objects cannot travel between processes"):
        resolve_model(ref.spec)


def test_worker_side_error_says_exactly_what_to_do() -> None:
    """What a worker raises for a graph built with a model object in the app."""
    with pytest.raises(UnknownModelError) as info:
        resolve_model("instance:SimulatedModel:7f3a0001")
    message = str(info.value)
    assert "'instance:SimulatedModel:7f3a0001'" in message
    assert "spec string such as 'openai:gpt-4o-mini'" in message
    assert "register_model(name, model)" in message and "--import" in message
    with pytest.raises(UnknownModelError, match="--import your_module"):
        resolve_model("tests-registry-nobody-registered-this")


def test_specs_and_registered_names_are_portable(registered: list[str]) -> None:
    assert model_ref("openai:m", "http://h/v1") == ModelRef("openai:m", "http://h/v1")
    assert model_ref("openai:m").portable
    registered.append(register_model("tests-registry-portable", SimulatedModel(latency_s=0.0)))
    assert model_ref("tests-registry-portable").portable
    assert not ModelRef.of(SimulatedModel(latency_s=0.0)).portable
    data = ModelRef.of("openai:m", "http://h/v1").to_data()
    assert data == {"spec": "openai:m", "base_url": "http://h/v1"}
    assert ModelRef.from_data(data) == ModelRef("openai:m", "http://h/v1")
    with pytest.raises(TypeError, match="malformed model reference"):
        ModelRef.from_data({"spec": 3})


def test_instance_registrations_do_not_keep_models_alive() -> None:
    model = SimulatedModel(latency_s=0.0)
    ref = model_ref(model)
    assert resolve_model(ref.spec) is model
    del model
    gc.collect()
    with pytest.raises(UnknownModelError):
        resolve_model(ref.spec)


def test_base_url_goes_with_a_spec_not_an_instance() -> None:
    with pytest.raises(ValueError, match="base_url"):
        model_ref(SimulatedModel(latency_s=0.0), "http://localhost:1/v1")
    assert model_ref("openai:m", "http://h/v1") == ModelRef("openai:m", "http://h/v1")


def test_environment_errors_are_not_reported_as_unknown_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASYNCGRAPH_MODEL_RPM", "fast")
    with pytest.raises(ModelConfigError, match="ASYNCGRAPH_MODEL_RPM='fast'"):
        resolve_model("simulated:0.123")


def test_register_rejects_non_models() -> None:
    with pytest.raises(TypeError, match="ChatModel"):
        register_model("x", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        register_model(" ", SimulatedModel())


def test_a_model_reference_shows_its_base_url_redacted() -> None:
    ref = ModelRef("openai:m", "http://u:ref-pass-1@llm:8000/v1?api-key=ref-key-2")
    assert repr(ref) == "ModelRef(spec='openai:m', base_url='http://u:***@llm:8000/v1?api-key=***')"
