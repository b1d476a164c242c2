"""Random-weight models for the architectures and RoPE variants beyond plain Llama, scaled down
from the real configurations (several layers; windows short enough for a test prompt to cross)."""

from __future__ import annotations

from services.tools.random_model import RandomModelSpec

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
             max_position_embeddings=512, init_std=0.15)

FAMILY_SPECS = {
    # Llama 3.1's rope_scaling with its original context scaled down, so the ramp between the
    # kept and the divided frequencies falls inside a 16-dimension head's frequencies.
    "llama3-rope": RandomModelSpec(**SMALL, seed=11, rope_theta=500000.0, rope_scaling=(
        ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", 64))),
    "linear-rope": RandomModelSpec(**SMALL, seed=12, rope_scaling=(("rope_type", "linear"), ("factor", 4.0))),
    "dynamic-rope": RandomModelSpec(**SMALL, seed=13, rope_scaling=(("rope_type", "dynamic"), ("factor", 2.0))),
    # Qwen2.5's long-context setting: yarn over 4x the original context.
    "qwen2-yarn": RandomModelSpec(**{**SMALL, "num_kv_heads": 1}, architecture="Qwen2ForCausalLM", seed=14,
                                  rope_theta=1e6, rope_scaling=(("rope_type", "yarn"), ("factor", 4.0),
                                                                ("original_max_position_embeddings", 128))),
}
