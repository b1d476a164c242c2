"""PEFT adapters read and checked against the base model: a good one loads, and each kind of
adapter this engine cannot serve exactly is refused with the file and the field or tensor named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.runtime.lora.adapter import AdapterError, load_adapter
from tests.helpers.lora_adapters import STORIES_CONFIG as MODEL
from tests.helpers.lora_adapters import write_adapter

MAX_RANK = 16


def refusal(directory: Path) -> str:
    with pytest.raises(AdapterError) as caught:
        load_adapter("tenant-a", directory, MODEL, MAX_RANK)
    return str(caught.value)


def test_a_good_adapter_loads_with_its_rank_scale_and_targets(tmp_path):
    adapter = load_adapter("tenant-a", write_adapter(tmp_path / "good"), MODEL, MAX_RANK)
    assert (adapter.rank, adapter.scale, adapter.target_modules) == (4, 2.0, ("down_proj", "q_proj", "v_proj"))
    assert len(adapter.weights) == 3 * MODEL.num_layers


def test_a_shape_that_does_not_fit_the_base_model_names_the_file_and_tensor(tmp_path):
    bad = {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.randn(4, 65)}
    message = refusal(write_adapter(tmp_path / "shape", tensors=bad))
    assert "adapter_model.safetensors" in message and "layers.1.self_attn.q_proj.lora_A.weight" in message
    assert "[4, 65]" in message and "[4, 64]" in message


def test_an_unknown_target_module_names_the_config_file_and_field(tmp_path):
    directory = write_adapter(tmp_path / "target", config={"target_modules": ["q_proj", "v_proj", "down_proj",
                                                                               "lm_head"]})
    message = refusal(directory)
    assert str(directory / "adapter_config.json") in message and "target_modules" in message and "'lm_head'" in message


def test_a_rank_above_the_limit_names_the_field_and_limit(tmp_path):
    directory = write_adapter(tmp_path / "rank", rank=32)
    message = refusal(directory)
    assert str(directory / "adapter_config.json") in message and "field r" in message
    assert "max_lora_rank=16" in message


def test_a_layer_past_the_model_is_refused(tmp_path):
    bad = {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
           "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}
    assert "layer 9 is past the base model's 5 layers" in refusal(write_adapter(tmp_path / "layer", tensors=bad))


def test_a_pickled_adapter_is_never_loaded(tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                               "target_modules": ["q_proj"]}))
    (directory / "adapter_model.bin").write_bytes(b"not read")
    message = refusal(directory)
    assert str(directory / "adapter_model.bin") in message and "pickle" in message


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                          ("rank_pattern", {"q_proj": 8})])
def test_settings_that_change_the_math_are_refused_by_field(tmp_path, field, value):
    directory = write_adapter(tmp_path / field, config={field: value})
    message = refusal(directory)
    assert str(directory / "adapter_config.json") in message and f"field {field}" in message
