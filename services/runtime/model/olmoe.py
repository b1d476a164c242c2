"""OLMoE: the Qwen3-MoE layer, except that q and k are RMS-normed over their whole projection
(all heads together) rather than per head."""

from __future__ import annotations

import torch

from services.runtime.model.layers import rms_norm
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.qwen3 import Qwen3Layer


class OlmoeLayer(Qwen3Layer):
    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, H + KH, hd] -> a new [T, H + KH, hd]; q over H * hd, k over KH * hd
        t, h = qk.shape[0], self.num_heads
        q = rms_norm(qk[:, :h].reshape(t, -1), self.q_norm, self.eps)
        k = rms_norm(qk[:, h:].reshape(t, -1), self.k_norm, self.eps)
        return torch.cat([q, k], 1).view(qk.shape)


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_class = OlmoeLayer
