"""Phi-3: the Llama layer, with q|k|v and gate|up stored as one matrix each (``qkv_proj``,
``gate_up_proj``) and, for the long-context models, ``longrope`` RoPE (rope.py).

The fused checkpoint matrices are split into the Llama names at load; the Llama layer fuses them
again into the same q|k|v and gate|up products, so nothing is copied twice at run time.
"""

from __future__ import annotations

import torch

from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.config import ModelConfig
from services.runtime.model.llama import LlamaForCausalLM


def split_fused(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """qkv_proj [q + 2kv, D] and gate_up_proj [2F, D] -> the q/k/v and gate/up weights of llama.py."""
    weights = dict(weights)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = weights.pop(p + "self_attn.qkv_proj.weight")
        if not isinstance(qkv, torch.Tensor):
            raise ValueError("a quantized Phi-3 checkpoint is not supported")
        weights |= {p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q : q + kv],
                    p + "self_attn.v_proj.weight": qkv[q + kv :]}
        gate, up = weights.pop(p + "mlp.gate_up_proj.weight").chunk(2, dim=0)
        weights |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    return weights


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                 device: torch.device, prepack_cpu_weights: bool = True, quant_activations: str = "none"):
        super().__init__(config, split_fused(config, weights), backend, device, prepack_cpu_weights,
                         quant_activations)
