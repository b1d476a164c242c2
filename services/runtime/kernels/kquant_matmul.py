"""GGUF's whole-block formats (q4_k, q5_k, q6_k, q5_0, q5_1; quant/gguf_blocks.py) times x on a GPU:
y = x W^T with W decoded from its blocks tile by tile in registers.

  x [M, K] (fp16, bf16 or fp32)   qweight [N, K / block * block bytes] uint8, the file's blocks
  y [M, N] = x @ dequantize(W, x.dtype)^T, accumulated in fp32

Each weight of a [BK, BN] tile is decoded where it lies: its block's fp16 scale(s), its
sub-block's integer scale (q4_k/q5_k: 6 bits packed in 12 bytes, ggml's get_scale_min_k4; q6_k:
an int8), its low 4 bits and its high bits, then the same fp32 operations in the same order as
gguf_blocks.dequantize, so the tile holds the reference's weights bit for bit before they are
rounded to x's dtype. The blocks are read as they are: loading a model repacks nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES, dot, dot_flags
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS

_FORMAT_IDS = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "q5_0": 3, "q5_1": 4}


@triton.jit
def _u8(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offs, mask):
    # two little-endian bytes -> the fp16 they spell, as fp32
    bits = _u8(ptr, offs, mask) | (_u8(ptr, offs + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decoded_tile(q_ptr, offs_k, offs_n, mask, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_BYTES: tl.constexpr, FORMAT: tl.constexpr):
    # -> W^T tile [BK, BN] in fp32 (zeros where masked)
    k = offs_k[:, None]
    n = offs_n[None, :]
    base = n * ROW_BYTES + (k // BLOCK) * BLOCK_BYTES  # the block's first byte
    v = k % BLOCK  # the value's place in its block
    if FORMAT <= 1:  # q4_k, q5_k: d, dmin, 12 bytes of scales, (q5_k: 32 bytes of fifth bits), nibbles
        g = v // 32
        j = v % 32
        d = _f16(q_ptr, base, mask)
        dmin = _f16(q_ptr, base + 2, mask)
        low_g = g < 4
        g4 = g % 4  # g for g < 4, g - 4 otherwise
        s_a = _u8(q_ptr, base + 4 + g4, mask)  # bytes 0-3: sc[g] (g < 4), top bits of sc[g + 4]
        s_b = _u8(q_ptr, base + 8 + g4, mask)  # bytes 4-7: m[g] (g < 4), top bits of m[g + 4]
        s_c = _u8(q_ptr, base + 12 + g4, mask)  # bytes 8-11: low bits of sc[g + 4], m[g + 4]
        sc = tl.where(low_g, s_a & 63, (s_c & 0x0F) | ((s_a >> 6) << 4))
        mn = tl.where(low_g, s_b & 63, (s_c >> 4) | ((s_b >> 6) << 4))
        qs = 16 + 32 * FORMAT  # the nibbles, after q5_k's 32 bytes of fifth bits
        q = (_u8(q_ptr, base + qs + (g // 2) * 32 + j, mask) >> ((g % 2) * 4)) & 0x0F
        if FORMAT == 1:
            q = q | (((_u8(q_ptr, base + 16 + j, mask) >> g) & 1) << 4)
        w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    elif FORMAT == 2:  # q6_k: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d
        g = v // 32
        j = v % 32
        half = g // 4
        gi = g % 4
        low = (_u8(q_ptr, base + half * 64 + (gi % 2) * 32 + j, mask) >> ((gi // 2) * 4)) & 0x0F
        high = (_u8(q_ptr, base + 128 + half * 32 + j, mask) >> (2 * gi)) & 3
        sc = _u8(q_ptr, base + 192 + v // 16, mask)
        sc = tl.where(sc > 127, sc - 256, sc)
        d = _f16(q_ptr, base + 208, mask)
        w = (d * sc.to(tl.float32)) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # q5_0 / q5_1: d (, m), 4 bytes of fifth bits, 16 bytes: value j low nibble, j + 16 high
        head = 2 + 2 * (FORMAT - 3)
        d = _f16(q_ptr, base, mask)
        high = (_u8(q_ptr, base + head + v // 8, mask) >> (v % 8)) & 1
        low = (_u8(q_ptr, base + head + 4 + v % 16, mask) >> ((v // 16) * 4)) & 0x0F
        q = low | (high << 4)
        if FORMAT == 3:
            w = d * (q - 16).to(tl.float32)
        else:
            w = d * q.to(tl.float32) + _f16(q_ptr, base + 2, mask)
    return tl.where(mask, w, 0.0)


@triton.jit
def _kquant_matmul_kernel(x_ptr, q_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                          ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                          FORMAT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
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
        w = _decoded_tile(q_ptr, offs_k, offs_n, w_mask, ROW_BYTES, BLOCK, BLOCK_BYTES, FORMAT)
        # The weight rounded to x's dtype, as the reference; fp32 gets true fp32 products (dot_flags).
        acc += dot(x, w.to(dtype), DOT_PRECISION, DOT_UPCAST)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(dtype),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def kquant_matmul(x: torch.Tensor, w: QuantizedWeight, block_m: int = 16, block_n: int = 64, block_k: int = 64
                  ) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T -> [M, N] in x's dtype, w in a whole-block GGUF format."""
    if w.fmt not in _FORMAT_IDS:
        raise ValueError(f"kquant_matmul takes {', '.join(_FORMAT_IDS)} weights, got {w.fmt}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, in_features] with unit last stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"x has {x.shape[1]} features, the weight {w.in_features}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    if not w.qweight.is_contiguous():
        raise ValueError("the weight's blocks must be contiguous")
    m, k = x.shape
    n = w.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block, block_bytes = BLOCK_FORMATS[w.fmt]
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _kquant_matmul_kernel[grid](
        x, w.qweight, out, m, n, k, x.stride(0), out.stride(0),
        ROW_BYTES=w.qweight.shape[1], BLOCK=block, BLOCK_BYTES=block_bytes, FORMAT=_FORMAT_IDS[w.fmt],
        **dot_flags(x.dtype, _kquant_matmul_kernel), BM=block_m, BN=block_n, BK=block_k, num_warps=4,
    )
    return out


def kquant_matmul_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Dequantize in fp32 (gguf's numbers), round to x's dtype, multiply in fp32, round to x's dtype."""
    weight = dequantize(w, x.dtype).float()
    return (x.float() @ weight.t()).to(x.dtype)
