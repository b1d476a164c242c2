"""Weight-only quantized matmul for the GPU: y = x W^T with W dequantized tile by tile in registers.

  x [M, K] (fp16, bf16 or fp32)   W [N, K] in a format of services/runtime/model/quant/formats.py
  y [M, N] = x @ dequantize(W, x.dtype)^T, accumulated in fp32

Decode is memory-bound: reading 4-bit weights instead of 16-bit ones reads a quarter of the
bytes, and the dequantization (a shift, a mask, a multiply-add per weight) hides under the loads.
The kernel reads the stored parts as they are (GGUF's nibble order: in a group of 32 values,
byte j holds value j in its low nibble and value j + 16 in its high one), so loading a model
repacks nothing. Each weight is rounded to x's dtype before the product, the same numbers as
``quant_matmul_reference`` (dequantize in fp32, round to x's dtype, matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES, dot, dot_flags
from services.runtime.model.quant.formats import QuantizedWeight, dequantize

_FORMAT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "int8": 2}
"""int8 (per channel) is q8_0 with one group as wide as the row and a scale stride of 0 along K."""


@triton.jit
def _dequantized_tile(q_ptr, s_ptr, m_ptr, offs_k, offs_n, mask, K, stride_sn, stride_sg,
                      GROUP: tl.constexpr, FORMAT: tl.constexpr):
    # -> W^T tile [BK, BN] in fp32 (zeros where masked)
    k = offs_k[:, None]
    n = offs_n[None, :]
    if FORMAT == 2:  # 8-bit values, one byte each
        q = tl.load(q_ptr + n * K + k, mask=mask, other=0).to(tl.float32)
    else:  # 4-bit: value k of a 32-value block is in byte k % 16 of it, high nibble for k % 32 >= 16
        byte = tl.load(q_ptr + n * (K // 2) + (k // 32) * 16 + (k % 16), mask=mask, other=0).to(tl.int32)
        q = ((byte >> (((k % 32) // 16) * 4)) & 0xF).to(tl.float32)
    s_offs = n * stride_sn + (k // GROUP) * stride_sg
    d = tl.load(s_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    if FORMAT == 0:  # q4_0: d * (q - 8)
        w = d * (q - 8.0)
    elif FORMAT == 1:  # q4_1: d * q + m
        w = d * q + tl.load(m_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    else:  # q8_0 / int8: d * q
        w = d * q
    return w


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_sn, stride_sg,
                         GROUP: tl.constexpr, FORMAT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         DOT_UPCAST: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tl.static_assert(BK >= 16 and BM >= 16 and BN >= 16, "tl.dot needs tiles of at least 16")
    offs_m = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = _dequantized_tile(q_ptr, s_ptr, m_ptr, offs_k, offs_n, w_mask, K, stride_sn, stride_sg, GROUP, FORMAT)
        # The weight rounded to x's dtype, as the reference; fp32 gets true fp32 products (dot_flags).
        acc += dot(x, w.to(dtype), DOT_PRECISION, DOT_UPCAST)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(dtype),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, block_m: int = 16, block_n: int = 64, block_k: int = 64
                 ) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T -> [M, N] in x's dtype."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, in_features] with unit last stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight {w.in_features}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    parts = w.parts()
    for name, tensor in parts.items():
        if not tensor.is_contiguous():
            raise ValueError(f"quantized weight part {name!r} must be contiguous")
    m, k = x.shape
    n = w.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if w.fmt == "int8":  # one scale per row: the group is the row, no stride along K
        group, stride_sn, stride_sg = k, 1, 0
    else:
        group, stride_sn, stride_sg = w.group_size, w.scales.stride(0), 1
    mins = w.mins if w.mins is not None else w.scales  # unread unless q4_1
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, w.qweight, w.scales, mins, out, m, n, k, x.stride(0), out.stride(0), stride_sn, stride_sg,
        GROUP=group, FORMAT=_FORMAT_IDS[w.fmt], **dot_flags(x.dtype, _quant_matmul_kernel),
        BM=block_m, BN=block_n, BK=block_k, num_warps=4,
    )
    return out


def quant_matmul_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Dequantize in fp32, round to x's dtype, multiply in fp32, round the result to x's dtype."""
    weight = dequantize(w, x.dtype).float()
    return (x.float() @ weight.t()).to(x.dtype)
