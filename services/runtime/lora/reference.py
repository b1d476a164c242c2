"""The batched low-rank update in plain PyTorch: one product per adapter present in the batch."""

from __future__ import annotations

import torch


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               row_slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y [T, out] += scales[s] * (x [T, in] @ A_s^T) @ B_s^T for each row with slot s >= 0."""
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (row_slots == slot).nonzero().squeeze(1)
        y[rows] += scales[slot] * ((x[rows] @ lora_a[slot].T) @ lora_b[slot].T)
    return y
