"""GGUF K-quant (q4_k, q5_k, q6_k) and q5_0/q5_1 weights times int8-quantized activations: the
reference of the CPU kernels (services/runtime/kernels/cpu/kquant_dot.cpp,
``torch.ops.tokenmill_quant.kquant_matmul``) and the tiles they read.

Input rows are rounded to int8 per block of 32 values, quant_act.py's rule (d = amax / 127,
round half to even). llama.cpp rounds a K-quant's input per block of 256 (its Q8_K), one scale
for 8 groups; on Gemma 3 270M's Q4_K_M file that moved perplexity over
benchmarks/data/smollm2_perplexity.txt by +1.31% from fp32's (24.681 -> 25.005; its K-quant
layers alone +0.41%), past the 1% this path is held to, so each 32 values get their own scale
here (docs/benchmarks.md, GGUF K-quants). Then, per output n, with the
weight's integer values q_w (gguf_blocks.OFFSET removed), its sub-blocks s (32 values; q6_k 16)
and their scale and offset (weight = scale_s q_w + offset_s, gguf_blocks.Unpacked.scale_offset):

    y[m, n] = sum_s d_x[m, block of s] (scale_s dot_s + offset_s sum_j q_x[m, s, j])
    dot_s   = sum_j q_w[n, s, j] q_x[m, s, j]     (an integer)

The kernels keep each group's sum in integers (sc_s dot_s and m_s sum q_x, the 6- or 8-bit
sub-block scales), scale it by its d_x, and the super-block's sums once by d and dmin, as
llama.cpp's ggml_vec_dot_q4_K_q8_K does with its one d_x. This reference sums in float64, so the
kernels differ from it only in the rounding of their fp32 sums.
"""

from __future__ import annotations

import torch

from services.runtime.kernels.quant_act import quantize_activations
from services.runtime.model.quant.formats import QuantizedWeight
from services.runtime.model.quant.gguf_blocks import BLOCK_FORMATS, OFFSET, SUB_BLOCK, VALUE_BITS, unpack

KQUANT_FORMAT_CODES = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "q5_0": 3, "q5_1": 4}
"""kquant_dot.cpp's KFormat."""
TILE = 16
"""Outputs per tile of a repacked weight."""


ACTIVATION_BLOCK = 32
"""Values per activation scale, for every format (see above)."""


def kquant_matmul_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] fp32 times the block weight ``w`` [N, K], x rounded to int8 as above -> [M, N] fp32."""
    if w.fmt not in KQUANT_FORMAT_CODES:
        raise ValueError(f"{w.fmt} is not one of {', '.join(KQUANT_FORMAT_CODES)}")
    block, sub = ACTIVATION_BLOCK, SUB_BLOCK[w.fmt]
    q, d, _ = quantize_activations(x, block)
    m, k = x.shape
    u = unpack(w.fmt, w.qweight)
    n = u.values.shape[0]
    scale, offset = u.scale_offset(w.fmt)
    qw = (u.values.to(torch.int32) - OFFSET.get(w.fmt, 0)).double().view(n, k // sub, sub)
    qx = q.double().view(m, k // sub, sub)
    dots = torch.einsum("msj,nsj->mns", qx, qw)  # integers below 2^53: exact
    dx = d.double().repeat_interleave(block // sub, dim=1)  # [M, S]: each sub-block's activation scale
    y = (dots * scale.double()[None]).mul(dx[:, None, :]).sum(-1)
    if offset is not None:
        y = y + (qx.sum(-1) * dx) @ offset.double().t()
    return y.float()


def pack_tiles(w: QuantizedWeight) -> torch.Tensor:
    """The weight as kquant_dot.cpp's tiles (its layout comment), uint8, outputs padded to 16."""
    u = unpack(w.fmt, w.qweight)
    n, k = u.values.shape
    t = (n + TILE - 1) // TILE
    pad = t * TILE - n
    block = BLOCK_FORMATS[w.fmt][0]
    b, g = k // block, block // 32

    def rows(a: torch.Tensor) -> torch.Tensor:  # pad the output rows to whole tiles
        return torch.cat([a, a.new_zeros((pad, *a.shape[1:]))]) if pad else a

    v = rows(u.values).to(torch.int32).view(t, TILE, b, g, 4, 2, 4)  # [tile, c, super, group, j, half, t]
    lo, hi = v[..., 0, :], v[..., 1, :]  # values 8j + t and 8j + 4 + t
    parts = [((lo & 15) | ((hi & 15) << 4)).permute(0, 2, 3, 4, 1, 5).reshape(t, b, g, 256)]
    shifts = 2 * torch.arange(4, dtype=torch.int32).view(4, 1)  # chunk j -> bits 2j, 2j + 1
    for p in range(VALUE_BITS[w.fmt] - 4):
        bit_lo, bit_hi = (lo >> (4 + p)) & 1, (hi >> (4 + p)) & 1
        plane = ((bit_lo << shifts) | (bit_hi << (shifts + 1))).sum(dim=4)  # [tile, c, super, group, t]
        parts.append(plane.permute(0, 2, 3, 1, 4).reshape(t, b, g, 64))
    groups = torch.cat(parts, dim=-1).reshape(t, b, -1)

    def per_tile(a: torch.Tensor) -> torch.Tensor:  # [N, B * per] -> [tile, super, per * 16] bytes, c fastest
        a = rows(a)
        per = a.shape[1] // b
        a = a.reshape(t, TILE, b, per).permute(0, 2, 3, 1).contiguous()
        return a.view(torch.uint8).reshape(t, b, -1)

    meta = [per_tile(u.d.contiguous())]
    if u.dmin is not None:
        meta.append(per_tile(u.dmin.contiguous()))
    if u.sc is not None:
        meta.append(per_tile(u.sc.to(torch.int8 if w.fmt == "q6_k" else torch.uint8)))
    if u.m is not None:
        meta.append(per_tile(u.m.to(torch.uint8)))
    return torch.cat([groups.to(torch.uint8), *meta], dim=-1).reshape(-1).contiguous()
