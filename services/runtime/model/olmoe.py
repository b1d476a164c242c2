"""OLMoE: the Qwen3-MoE layer, except that q and k are RMS-normed over their whole projection
(all heads together) rather than per head.

Under tensor parallelism a rank holds some of the heads, so its share of each norm's sum of
squares is summed over the ranks (``SpanNorm``, one [T, 2] all-reduce a layer) before each rank
normalizes its heads with its slice of the norm weights. Where KV heads are replicated (fewer
than ranks) each is counted once: the sum of its copies is divided by their number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from services.runtime.model.layers import rms_norm
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.qwen3 import Qwen3Layer


@dataclass(frozen=True, slots=True)
class SpanNorm:
    """What a rank needs to norm its heads over all ranks' widths."""

    all_reduce: Callable[[torch.Tensor], None]
    """Sums a contiguous fp32 tensor in place over the ranks."""
    q_width: int
    """num_heads * head_dim of the whole model."""
    k_width: int
    """num_kv_heads * head_dim of the whole model."""
    k_copies: int
    """Ranks holding each KV head (1 unless the KV heads are replicated)."""


class OlmoeLayer(Qwen3Layer):
    span_norm: SpanNorm | None = None
    """Set under tensor parallelism (parallel/rank.py); None: the rank holds every head."""

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, H + KH, hd] -> a new [T, H + KH, hd]; q over H * hd, k over KH * hd
        t, h = qk.shape[0], self.num_heads
        q, k = qk[:, :h].reshape(t, -1), qk[:, h:].reshape(t, -1)
        if self.span_norm is None:
            return torch.cat([rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)], 1).view(qk.shape)
        span = self.span_norm
        qf, kf = q.float(), k.float()
        sums = torch.stack([qf.square().sum(-1), kf.square().sum(-1) / span.k_copies], 1).contiguous()
        span.all_reduce(sums)
        q = (qf * torch.rsqrt(sums[:, :1] / span.q_width + self.eps)).to(q.dtype) * self.q_norm
        k = (kf * torch.rsqrt(sums[:, 1:] / span.k_width + self.eps)).to(k.dtype) * self.k_norm
        return torch.cat([q, k], 1).view(qk.shape)


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_class = OlmoeLayer
