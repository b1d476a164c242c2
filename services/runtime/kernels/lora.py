"""Batched LoRA: each row of a step adds the low-rank update of its own adapter.

  y[t] += scales[s] * B_s (A_s x[t])        for every row t with s = row_slots[t] >= 0

Shapes: y [T, out], x [T, in], lora_a [S, R, in], lora_b [S, out, R], row_slots [T] int32 or
int64 (-1: the row has no adapter), scales [S] float32 (alpha / rank). An adapter of rank r < R
is padded with zeros to R, which adds nothing. The update is computed in fp32 (adapters are
fp32 whatever the base weights are) and added to y with one rounding to y's dtype.

This is punica's BGMV/SGMV idea: one step serves rows of many adapters (and of none), and each
adapter's A and B are read once per step for all its rows, shrink (x A^T, [rows, R]) before
expand (. B^T, [rows, out]). ``lora_apply`` picks the kernel for the device; ``lora_reference``
is the PyTorch statement of the math every kernel is tested against.
"""

from __future__ import annotations

import torch

from services.runtime.kernels._common import FLOAT_DTYPES


def check_lora_inputs(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices (not the slot values: reading them would sync a GPU)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [T, in] and y [T, out] with the same T, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype not in FLOAT_DTYPES or y.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and y must be float16, bfloat16 or float32, got {x.dtype} and {y.dtype}")
    num_slots, rank, in_features = lora_a.shape if lora_a.dim() == 3 else (-1, -1, -1)
    if in_features != x.shape[1]:
        raise ValueError(f"lora_a must be [slots, rank, {x.shape[1]}], got {tuple(lora_a.shape)}")
    if tuple(lora_b.shape) != (num_slots, y.shape[1], rank):
        raise ValueError(f"lora_b must be [{num_slots}, {y.shape[1]}, {rank}] to match lora_a "
                         f"{tuple(lora_a.shape)} and y {tuple(y.shape)}, got {tuple(lora_b.shape)}")
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"lora_a and lora_b must share one float dtype, got {lora_a.dtype} and {lora_b.dtype}")
    if row_slots.dtype not in (torch.int32, torch.int64) or tuple(row_slots.shape) != (x.shape[0],):
        raise ValueError(f"row_slots must be int32 or int64 [{x.shape[0]}], got {row_slots.dtype} "
                         f"{tuple(row_slots.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (num_slots,):
        raise ValueError(f"scales must be float32 [{num_slots}], got {scales.dtype} {tuple(scales.shape)}")
    for name, tensor in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b), ("row_slots", row_slots),
                         ("scales", scales)):
        if tensor.device != y.device:
            raise ValueError(f"{name} must be on {y.device} with y, got {tensor.device}")


def check_slot_values(row_slots: torch.Tensor, num_slots: int) -> None:
    """Every entry of row_slots is -1 or a slot in [0, num_slots)."""
    if row_slots.numel() and (int(row_slots.min()) < -1 or int(row_slots.max()) >= num_slots):
        bad = int(((row_slots < -1) | (row_slots >= num_slots)).nonzero()[0, 0])
        raise ValueError(f"row_slots[{bad}] = {int(row_slots[bad])} must be -1 (no adapter) or a slot in "
                         f"[0, {num_slots})")


def lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """y [T, out] += scales[s] * (x @ A_s^T) @ B_s^T per row of slot s (in place; y is returned)."""
    check_lora_inputs(y, x, lora_a, lora_b, row_slots, scales)
    check_slot_values(row_slots, lora_a.shape[0])
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (row_slots == slot).nonzero().squeeze(1)
        shrunk = x[rows].float() @ lora_a[slot].float().T  # [rows, R]
        delta = shrunk @ lora_b[slot].float().T  # [rows, out]
        y[rows] = (y[rows].float() + scales[slot] * delta).to(y.dtype)
    return y


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    row_slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """``lora_reference``'s update with the fastest kernel for y's device; y is returned."""
    return lora_reference(y, x, lora_a, lora_b, row_slots, scales)
