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
    # Qwen3-0.6B's layout: head_dim 128 at hidden 1024 / 16 heads, i.e. heads wider than hidden / heads.
    "qwen3": RandomModelSpec(**{**SMALL, "num_heads": 8, "num_kv_heads": 2}, architecture="Qwen3ForCausalLM",
                             seed=15, head_size=32, rope_theta=1e6, tie_word_embeddings=True),
    # Mistral's window on every layer, shorter than the prompts.
    "mistral-window": RandomModelSpec(**SMALL, architecture="MistralForCausalLM", seed=16, sliding_window=16),
    # Gemma 3 270M's layout scaled down: 4 query heads, 1 KV head, heads wider than hidden / heads,
    # local layers with a window shorter than the prompts and global ones (every 3rd here, 6th there).
    "gemma3": RandomModelSpec(**{**SMALL, "num_layers": 6, "num_kv_heads": 1}, architecture="Gemma3ForCausalLM",
                              seed=17, head_size=64, rope_theta=1e6, sliding_window=16, sliding_window_pattern=3,
                              tie_word_embeddings=True),
    # Gemma 3 4B and up: linear RoPE scaling on the global layers only.
    "gemma3-linear-rope": RandomModelSpec(**{**SMALL, "num_layers": 4, "num_kv_heads": 2},
                                          architecture="Gemma3ForCausalLM", seed=18, head_size=32, rope_theta=1e6,
                                          sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=True,
                                          rope_scaling=(("rope_type", "linear"), ("factor", 8.0))),
    # Gemma 2 2B's layout scaled down (4 query heads over 2 KV heads of 64, local and global
    # layers alternating), its caps lowered to where random weights' scores and logits reach them.
    "gemma2": RandomModelSpec(**{**SMALL, "num_layers": 4}, architecture="Gemma2ForCausalLM", seed=20,
                              head_size=64, sliding_window=16, tie_word_embeddings=True,
                              attn_logit_softcapping=3.0, final_logit_softcapping=8.0),
    # Phi-3-mini-128k's layout: fused q|k|v and gate|up, longrope over 4x its original context
    # (sequences here stay inside it, where transformers uses the short factors), a window.
    "phi3-longrope": RandomModelSpec(**{**SMALL, "num_kv_heads": 4, "max_position_embeddings": 1024},
                                     architecture="Phi3ForCausalLM", seed=19, sliding_window=48, rope_scaling=(
        ("rope_type", "longrope"), ("original_max_position_embeddings", 256),
        ("short_factor", tuple(1.0 + 0.05 * i for i in range(16))), ("long_factor", tuple(1.5 + 0.5 * i for i in range(16))))),
}
