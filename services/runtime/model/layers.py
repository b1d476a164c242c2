"""Small building blocks of the Llama family: RMSNorm and rotary embeddings (rotate-half)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.runtime.model.rope import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, scale in the input dtype: the same rounding as Hugging Face's LlamaRMSNorm.

    In fp32 that is torch's fused op with the weight (one call instead of seven; bitwise equal
    to ``weight * (x * rsqrt(mean(x^2) + eps))``). In half precision the normalized value is
    rounded to x's dtype before the weight multiplies it, as Hugging Face does.
    """
    # x: [T, D], weight: [D]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions), rotate-half layout:
    dimension i is paired with i + head_dim/2 (Hugging Face's convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device,
                 scaling: RopeScaling | None = None):
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        scaling = scaling or RopeScaling(theta)
        # rope.py: a scaled type's frequencies, those past the original context where they differ,
        # and the factor cos and sin are multiplied by (yarn, longrope), as transformers does.
        inv_freq, inv_freq_long, long_from, attention_scaling = scaling.frequencies(head_dim, max_positions)
        max_positions = scaling.served_positions(max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        if inv_freq_long is not None and long_from < max_positions:
            freqs[long_from:] = torch.outer(t[long_from:], inv_freq_long)
        self.cos = (freqs.cos() * attention_scaling).to(device)  # fp32 [P, D/2]
        self.sin = (freqs.sin() * attention_scaling).to(device)
        # Full-width tables for one multiply per half: out = x * cos_full + swap_halves(x) * sin_signed,
        # i.e. x1*cos - x2*sin | x2*cos + x1*sin (adding -(x2*sin) rounds exactly as subtracting it).
        self.cos_full = torch.cat([self.cos, self.cos], dim=-1)  # fp32 [P, D]
        self.sin_signed = torch.cat([-self.sin, self.sin], dim=-1)  # fp32 [P, D]
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos_full, sin_signed) at ``positions`` in ``dtype``, [T, 1, D]: gathered once per step."""
        return (self.cos_full[positions].unsqueeze(1).to(dtype),
                self.sin_signed[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, heads, D] (any token/head strides), tables from ``tables`` -> new [T, heads, D]
        cos, sin = tables
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # x2 | x1
        return x * cos + swapped * sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D], positions: [T]
        return self.rotate(x, self.tables(positions, x.dtype))
