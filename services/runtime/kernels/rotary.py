"""Rotary position embedding, Hugging Face rotate-half layout, applied IN PLACE to q and k.

Dimension i pairs with i + D/2 (not with i + 1 as in the interleaved GPT-J layout):
  out[i]       = x[i] * cos[pos, i] - x[i + D/2] * sin[pos, i]
  out[i + D/2] = x[i + D/2] * cos[pos, i] + x[i] * sin[pos, i]      for i < D/2
computed in fp32 and rounded once to x's dtype.

Shapes (T = tokens, H = query heads, KH = kv heads, D = head dim):
  q [T, H, D], k [T, KH, D]   any token/head strides (views into a fused qkv work), unit last stride
  positions [T] int64
  cos, sin [max_position, D/2]  (any float dtype; fp32 recommended)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES, NOT_SPECIALIZED


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half_dims, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & (half_dims[None, :] < HALF)  # [H_PAD, HALF_PAD]
    first_ptrs = x_ptr + heads[:, None] * stride_h + half_dims[None, :]
    x1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first_ptrs, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(first_ptrs + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit(**NOT_SPECIALIZED)
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    half_dims = tl.arange(0, HALF_PAD)
    half_valid = half_dims < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + half_dims, mask=half_valid, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + half_dims, mask=half_valid, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, half_dims, HEADS_PAD, HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half_dims, KV_HEADS_PAD, HALF)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, KH, D] in place at ``positions``; returns (q, k).
    Positions must lie in [0, max_position) (not checked on device)."""
    _check_inputs(q, k, positions, cos, sin)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        num_heads, k.shape[1],
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
    return q, k


def rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face apply_rotary_pos_emb in fp32, out of place: returns new (q, k)."""

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
        cos_full = torch.cat([cos[positions], cos[positions]], dim=-1).float()[:, None, :]  # [T, 1, D]
        sin_full = torch.cat([sin[positions], sin[positions]], dim=-1).float()[:, None, :]
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        rotated_half = torch.cat([-second, first], dim=-1)
        return (x32 * cos_full + rotated_half * sin_full).to(x.dtype)

    return rotate(q), rotate(k)


def _check_inputs(q, k, positions, cos, sin) -> None:
    for name, tensor in (("q", q), ("k", k)):
        if tensor.dim() != 3 or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be [tokens, heads, head_dim] with unit last stride, got "
                             f"{tuple(tensor.shape)} strides {tensor.stride()}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {tensor.dtype}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.device != q.device:
        raise ValueError(f"k {tuple(k.shape)} on {k.device} must match q {tuple(q.shape)} on {q.device} "
                         f"in tokens, head_dim and device")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (num_tokens,) or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous int64 [{num_tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.stride(-1) != 1:
            raise ValueError(f"{name} must be [max_position, {head_dim // 2}] with unit last stride, got "
                             f"{tuple(table.shape)} strides {table.stride()}")
        if table.dtype not in FLOAT_DTYPES or table.device != q.device:
            raise ValueError(f"{name} must be a float tensor on {q.device}, got {table.dtype} on {table.device}")
    if positions.device != q.device:
        raise ValueError(f"positions must be on {q.device}, got {positions.device}")
