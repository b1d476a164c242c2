"""Small building blocks of the Llama family: RMSNorm and rotary embeddings (rotate-half)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, scale in the input dtype: the same rounding as Hugging Face's LlamaRMSNorm."""
    # x: [T, D], weight: [D]
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions), rotate-half layout:
    dimension i is paired with i + head_dim/2 (Hugging Face's convention)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, device: torch.device):
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.cos = freqs.cos()  # fp32 [P, D/2]
        self.sin = freqs.sin()
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D], positions: [T]
        half = x.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
