"""Write the step's new K/V into the paged pool at their slots.

Shapes (T = new tokens, KH = kv heads, D = head dim):
  k, v          [T, KH, D]
  k/v cache     [num_blocks, block_size, KH, D]
  slot_mapping  [T] int64   block_id * block_size + offset; -1 = padding token, not written

A quantized pool (kv_quant.ScaledCache: int8 or float8_e4m3fn values, fp16 scales
[num_blocks, block_size, KH]) is written by kv_quant's rule: each (token, kv head) row gets
scale = fp16(amax / QMAX) and its values divided by it. One program per token holds all KH x D
of its values, so the row maxima need no second pass, and it stores the KH scales of its slot
contiguously.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES, NOT_SPECIALIZED, kv_quant_args, split_pool
from services.runtime.kernels.kv_quant import MAX_SCALE, MIN_SCALE, QMAX, ScaledCache, write_quantized


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr,
                   INT8: tl.constexpr):
    """x [KH_PAD, D_PAD] (padding lanes 0) -> (values, fp16 scales [KH_PAD]) by kv_quant's rule."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    scale = tl.minimum(tl.maximum(amax / QMAX, MIN_SCALE), MAX_SCALE).to(tl.float16)
    y = xf / scale.to(tl.float32)[:, None]
    if INT8:
        values = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        values = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.float8e4nv)
    return values, scale


@triton.jit(**NOT_SPECIALIZED)
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr, INT8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    MAX_SCALE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64: slot ids of a big pool pass 2^31
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [KH_PAD, D_PAD]

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # other=0: padding lanes must not raise a quantized row's amax
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    k_dst = block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch + dims[None, :]
    v_dst = block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch + dims[None, :]
    if KV_QUANT:
        # scales [NB, BS, KH] contiguous: slot * KH + head
        head_valid = heads < NUM_KV_HEADS
        k, k_scale = _quantize_rows(k, QMAX, MIN_SCALE, MAX_SCALE, INT8)
        v, v_scale = _quantize_rows(v, QMAX, MIN_SCALE, MAX_SCALE, INT8)
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + heads, k_scale, mask=head_valid)
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + heads, v_scale, mask=head_valid)
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: "torch.Tensor | ScaledCache",
    v_cache: "torch.Tensor | ScaledCache",
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k/v [T, KH, D] into the caches at ``slot_mapping`` (in place); slots < 0 are skipped.
    Slots must be distinct (two tokens writing one slot race) and < num_blocks * block_size.
    Quantized pools (ScaledCache) get values and scales; k/v may then be any float dtype."""
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_cache, v_cache, k_scale, v_scale, quantized = kv_quant_args(k_cache, v_cache)
    qmax = QMAX.get(k_cache.dtype, 1.0)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        KV_QUANT=quantized, INT8=k_cache.dtype == torch.int8, QMAX=qmax, MIN_SCALE=MIN_SCALE, MAX_SCALE=MAX_SCALE,
        num_warps=4,
    )


def reshape_and_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Token-by-token reference of ``reshape_and_cache`` (in place); quantized pools through
    kv_quant.write_quantized, the rule's torch form."""
    if isinstance(k_cache, ScaledCache):
        write_quantized(k, v, k_cache, v_cache, slot_mapping)
        return
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[token]
        v_cache[slot // block_size, slot % block_size] = v[token]


def _check_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dim() != 3 or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be [tokens, kv_heads, head_dim] with unit last stride, got "
                             f"{tuple(tensor.shape)} strides {tensor.stride()}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k.dtype not in FLOAT_DTYPES:
        raise ValueError(f"k dtype must be float16, bfloat16 or float32, got {k.dtype}")
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        cache, scale = split_pool(pool)
        if cache.dim() != 4 or cache.stride(-1) != 1:
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim] with unit last "
                             f"stride, got {tuple(cache.shape)} strides {cache.stride()}")
        if cache.shape[2:] != k.shape[1:]:
            raise ValueError(f"{name} heads/head_dim {tuple(cache.shape[2:])} != k's {tuple(k.shape[1:])}")
        if (scale is None and cache.dtype != k.dtype) or cache.device != k.device:
            raise ValueError(f"{name} must match k ({k.dtype} on {k.device}), got {cache.dtype} on {cache.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v must match k ({k.dtype} on {k.device}), got {v.dtype} on {v.device}")
    if (slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (k.shape[0],)
            or not slot_mapping.is_contiguous() or slot_mapping.device != k.device):
        raise ValueError(f"slot_mapping must be contiguous int64 [{k.shape[0]}] on {k.device}, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}")
