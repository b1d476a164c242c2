"""Qwen3: the Llama layer with an RMSNorm over each q and k head before RoPE, and no q/k/v bias."""

from __future__ import annotations

import torch
from torch import nn

from services.runtime.model.config import ModelConfig
from services.runtime.model.layers import rms_norm
from services.runtime.model.llama import LlamaForCausalLM, LlamaLayer


class Qwen3Layer(LlamaLayer):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, index: int = 0):
        self_attn = prefix + "self_attn."
        q_norm, k_norm = weights.pop(self_attn + "q_norm.weight"), weights.pop(self_attn + "k_norm.weight")
        super().__init__(config, weights, prefix, index)
        self.q_norm = nn.Parameter(q_norm, requires_grad=False)  # [hd]
        self.k_norm = nn.Parameter(k_norm, requires_grad=False)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, H + KH, hd] -> a new [T, H + KH, hd], each head normalized over hd
        h = self.num_heads
        return torch.cat([rms_norm(qk[:, :h], self.q_norm, self.eps), rms_norm(qk[:, h:], self.k_norm, self.eps)], 1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3Layer
