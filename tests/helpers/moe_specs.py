"""Random-weight mixture-of-experts models for the parity tests: each family's routing rule,
several layers, 8 to 64 experts, top-2 and top-8, scaled down from the real configurations."""

from __future__ import annotations

from services.tools.random_model import RandomModelSpec

_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
              max_position_embeddings=512, init_std=0.15)

MOE_SPECS = {
    # Mixtral 8x7B: 8 experts, top-2, renormalized.
    "mixtral": RandomModelSpec(**_SMALL, architecture="MixtralForCausalLM", seed=31, rope_theta=1e6,
                               num_experts=8, num_experts_per_tok=2),
    # Qwen3-30B-A3B: 128 experts top-8 renormalized (64 here), per-head q/k norms, one dense layer.
    "qwen3-moe": RandomModelSpec(**_SMALL, architecture="Qwen3MoeForCausalLM", seed=32, head_size=32,
                                 rope_theta=1e6, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=(1,)),
    # OLMoE-1B-7B: 64 experts top-8 (16 here), not renormalized, q/k norms over the whole projections.
    "olmoe": RandomModelSpec(**{**_SMALL, "intermediate_size": 32}, architecture="OlmoeForCausalLM", seed=33,
                             num_experts=16, num_experts_per_tok=8),
    # Qwen1.5-MoE-A2.7B: a sigmoid-gated shared expert beside 60 routed ones top-4 (12 here), q/k/v biases.
    "qwen2-moe": RandomModelSpec(**_SMALL, architecture="Qwen2MoeForCausalLM", seed=34, num_experts=12,
                                 num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=80),
}
