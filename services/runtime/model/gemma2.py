"""Gemma 2: Gemma 3's layer (gemma3.py) without q/k norms and with one RoPE for every layer,
local (sliding-window) and global layers alternating from the first, and tanh soft-capping:

  - attention scores ``c * tanh(s / c)`` (``attn_logit_softcapping``, 50 in the released models)
    after scaling by query_pre_attn_scalar^-0.5 and before the mask and softmax,
  - logits ``c * tanh(logits / c)`` (``final_logit_softcapping``, 30).

Capped scores need an attention that computes them: the torch backend does (an explicit
matmul, tanh, softmax), the cpu backend's C++ decode kernel and the Triton kernels take the cap,
and so does the fused C++ decode step (both caps). The compiled CPU decode step refuses a capped
model by name.
"""

from __future__ import annotations

import torch

from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.config import ModelConfig
from services.runtime.model.gemma3 import Gemma3ForCausalLM

SOFTCAP_BACKENDS = ("torch", "cpu", "triton")
"""The attention backends that cap scores (``attend(..., softcap=c)``)."""


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                 device: torch.device, prepack_cpu_weights: bool = True, quant_activations: str = "none"):
        if config.attn_logit_softcapping is not None and backend.name not in SOFTCAP_BACKENDS:
            raise ValueError(f"{config.architecture} caps attention scores (attn_logit_softcapping), which the "
                             f"{backend.name!r} attention backend does not; use one of {', '.join(SOFTCAP_BACKENDS)}")
        super().__init__(config, weights, backend, device, prepack_cpu_weights, quant_activations)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
