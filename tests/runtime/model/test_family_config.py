"""Reading each family's config.json: per-layer windows, Gemma 3's two RoPEs, no context cap from a window."""

from __future__ import annotations

import pytest

from services.runtime.model.config import ModelConfig

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 32768}


def test_a_window_no_longer_caps_the_context():
    config = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert config.max_model_len == 32768
    assert config.layer_windows == (4096,) * 6


def test_gemma3_config_as_google_ships_it():
    """transformers 4.5x's format: rope_theta + rope_local_base_freq, a pattern instead of layer_types."""
    raw = {**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"}
    config = ModelConfig.from_dict(raw)
    assert config.layer_windows == (512, 512, 512, 512, 512, None)
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1e6, "linear", 8.0)
    assert (config.rope_local.theta, config.rope_local.rope_type) == (1e4, "default")
    assert config.max_model_len == 32768 and config.tie_word_embeddings and config.qk_norm
    assert config.query_pre_attn_scalar == 256


def test_qwen2_windows_only_from_max_window_layers_on_and_only_when_used():
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 4}
    assert ModelConfig.from_dict(raw).layer_windows == ()
    assert ModelConfig.from_dict({**raw, "use_sliding_window": True}).layer_windows == (None,) * 4 + (8, 8)


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capping_outside_gemma2_is_refused_by_name(key):
    raw = {**BASE, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh", key: 30.0}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match=f"{key} must be > 0"):
        ModelConfig.from_dict({**raw, "architectures": ["Gemma2ForCausalLM"], key: 0})


def test_gemma2_config_without_layer_types_alternates_local_and_global_layers():
    """Gemma 2's released config.json has no layer_types: layers 0, 2, ... are local, as transformers rules."""
    raw = {**BASE, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
           "sliding_window": 4096, "query_pre_attn_scalar": 224, "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0, "head_dim": 128}
    config = ModelConfig.from_dict(raw)
    assert config.family == "gemma2" and config.layer_windows == (4096, None) * 3
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.query_pre_attn_scalar == 224 and config.rope_local is None and not config.qk_norm
    assert config.tie_word_embeddings
