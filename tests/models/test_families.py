"""The family registry: each prepared model is served by its family, and a model no family claims is
refused with a message that names the registered families."""

from __future__ import annotations

import json

import pytest

from asyncwebrl.models.families import ModelFamily, family_class, family_for_config, register, registered
from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, detect_family, load_model

BUILT_IN = ["idefics3", "qwen2_vl", "qwen3_vl", "text"]


def test_the_built_in_families_are_registered_by_name():
    assert set(BUILT_IN) <= set(registered())
    for name in BUILT_IN:
        assert family_class(name).name == name


@pytest.mark.parametrize("model, family", [("default", "idefics3"), ("tiny-qwen2.5-vl", "qwen2_vl"),
                                           ("tiny-qwen3-vl", "qwen3_vl")])
def test_each_prepared_model_is_served_by_its_family(model, family):
    assert detect_family(resolve_model_path(model)) == family


@pytest.mark.parametrize("config, family", [
    ({"model_type": "smolvlm", "vision_config": {}}, "idefics3"),
    ({"model_type": "qwen2_vl", "vision_config": {}}, "qwen2_vl"),
    ({"model_type": "qwen3_vl_moe", "vision_config": {}}, "qwen3_vl"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "text"),
    ({"model_type": "qwen2"}, "text"),
])
def test_detection_reads_the_config(config, family):
    assert family_for_config(config).name == family


def test_an_unknown_vision_model_is_refused_naming_the_registered_families(tmp_path):
    cfg = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for load in (VLMAdapter, load_model):
        with pytest.raises(ValueError, match="model_type 'llava'") as err:
            load(str(tmp_path))
        for name in BUILT_IN:
            assert name in str(err.value)
        assert "asyncwebrl/models/families/" in str(err.value)  # where to add one


def test_a_config_without_model_type_is_refused():
    with pytest.raises(ValueError, match="no model family serves model_type None"):
        family_for_config({"architectures": ["Mystery"]})


def test_a_second_family_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        @register
        class Impostor(ModelFamily):
            name = "qwen2_vl"

    assert family_class("qwen2_vl").__name__ == "Qwen2VLFamily"
