"""A mixture-of-experts model's routed MLP, read from config.json (moe.py runs it).

The families differ in their key names and in a few rules:
  - Mixtral: ``num_local_experts`` experts of ``intermediate_size``, every layer sparse, the
    top-k probabilities renormalized to sum to 1 (Mixtral's reference code takes the top-k
    logits and softmaxes those, which is the same distribution);
  - Qwen2-MoE / Qwen3-MoE: ``num_experts`` experts of ``moe_intermediate_size``, renormalized
    when ``norm_topk_prob``; layers listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` grid keep a dense MLP of ``intermediate_size``; Qwen2-MoE adds a
    shared expert of ``shared_expert_intermediate_size`` scaled by sigmoid(x . w_gate);
  - OLMoE: ``num_experts`` experts of ``intermediate_size``, ``norm_topk_prob`` (off in OLMoE-1B-7B).
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    """Experts each token is routed to (``num_experts_per_tok``)."""
    intermediate_size: int
    """Each expert's FFN width."""
    renormalize: bool
    """The top-k weights are divided by their sum (Mixtral always; the others per ``norm_topk_prob``)."""
    sparse_layers: frozenset[int]
    """The layers whose MLP is routed; the others are dense."""
    router_order: str = "softmax_topk"
    """softmax over all experts then top-k (every family here), or top-k logits then a softmax over them."""
    shared_expert_size: int = 0
    """Qwen2-MoE: the width of the expert every token also goes through, gated by a sigmoid (0: none)."""

    @classmethod
    def from_dict(cls, raw: dict, arch: str, num_layers: int) -> "MoeConfig | None":
        if arch not in MOE_ARCHITECTURES:
            return None

        def positive(key: str, value) -> int:
            if value is None or int(value) < 1:
                raise ValueError(f"config.json {key} must be >= 1 for {arch}, got {value!r}")
            return int(value)

        experts_key = "num_local_experts" if arch == "MixtralForCausalLM" or "num_experts" not in raw else "num_experts"
        num_experts = positive(experts_key, raw.get(experts_key))
        top_k = positive("num_experts_per_tok", raw.get("num_experts_per_tok"))
        if top_k > num_experts:
            raise ValueError(f"config.json num_experts_per_tok ({top_k}) exceeds the {num_experts} experts")
        size_key = "moe_intermediate_size" if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") \
            else "intermediate_size"
        size = positive(size_key, raw.get(size_key))
        sparse = frozenset(range(num_layers))
        if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            step = positive("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
            dense = set(raw.get("mlp_only_layers") or ())
            sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        shared = 0
        if arch == "Qwen2MoeForCausalLM":
            shared = int(raw.get("shared_expert_intermediate_size") or 0)
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=size,
                   renormalize=True if arch == "MixtralForCausalLM" else bool(raw.get("norm_topk_prob", False)),
                   sparse_layers=sparse, shared_expert_size=shared)
