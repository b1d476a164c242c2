"""RoPE tables against transformers' own frequency functions, where a whole-model parity test
cannot reach them: the types whose frequencies change past the original context."""

from __future__ import annotations

import pytest
import torch

from services.runtime.model.config import ModelConfig
from services.runtime.model.layers import RotaryEmbedding
from services.runtime.model.rope import RopeScaling

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM, MAX_POS = 16, 64


def hf_inv_freq(rope_parameters: dict, seq_len: int) -> tuple[torch.Tensor, float]:
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                      max_position_embeddings=MAX_POS, rope_parameters=rope_parameters)
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, torch.device("cpu"), seq_len=seq_len)


def expected_table(inv_freq: torch.Tensor, positions: range, scale: float) -> torch.Tensor:
    return torch.outer(torch.tensor(list(positions), dtype=torch.float32), inv_freq).cos() * scale


def test_dynamic_is_plain_inside_the_context_and_ntk_for_the_served_length_past_it():
    params = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, torch.device("cpu"), RopeScaling.from_dict(params, 1e4, MAX_POS))
    assert rotary.max_positions == 4 * MAX_POS
    short, _ = hf_inv_freq(params, MAX_POS)
    long, _ = hf_inv_freq(params, 4 * MAX_POS)
    torch.testing.assert_close(rotary.cos[:MAX_POS], expected_table(short, range(MAX_POS), 1.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.cos[MAX_POS:], expected_table(long, range(MAX_POS, 4 * MAX_POS), 1.0),
                               rtol=0, atol=1e-5)
    assert not torch.allclose(short, long)


def test_longrope_uses_short_factors_inside_the_original_context_and_long_ones_past_it():
    half = HEAD_DIM // 2
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
              "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, torch.device("cpu"), RopeScaling.from_dict(params, 1e4, MAX_POS))
    short, scale = hf_inv_freq(params, 16)
    long, long_scale = hf_inv_freq(params, 17)
    assert scale == long_scale > 1.0
    torch.testing.assert_close(rotary.cos[:16], expected_table(short, range(16), scale), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.cos[16:], expected_table(long, range(16, MAX_POS), scale), rtol=0, atol=1e-5)


@pytest.mark.parametrize("params", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4,
     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e4},
])
def test_position_independent_types_match_transformers(params):
    ours = RopeScaling.from_dict(params, params["rope_theta"], MAX_POS)
    inv_freq, long, _, scale = ours.frequencies(HEAD_DIM, MAX_POS)
    ref, ref_scale = hf_inv_freq(params, MAX_POS)
    assert long is None and scale == pytest.approx(ref_scale, abs=1e-12)
    torch.testing.assert_close(inv_freq, ref, rtol=0, atol=0)


def test_an_unknown_rope_type_is_refused_by_name():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2}}
    with pytest.raises(ValueError, match="'ntk-by-parts' is not supported"):
        ModelConfig.from_dict(raw)
