"""Quantized weights times int8-quantized activations: the reference of the CPU kernels
(services/runtime/kernels/cpu/quant_dot.cpp, ``torch.ops.tokenmill_quant.quant_matmul_int8``).

llama.cpp multiplies its block-quantized weights by activations it first rounds to 8 bits per
block of 32 (its Q8_0 and Q8_1 formats), so that a block's product is one integer dot product.
The same rule here, per row of x [M, K] and per block of 32 values:

    amax = max |x_j|            (0 when below fp32's smallest normal)
    d    = amax / 127           (fp32; llama.cpp rounds it to fp16, kept in fp32 here)
    q_j  = round_half_even(x_j * (127 / amax))  in -127..127   (0 when amax is 0)

and, with a GGUF block-quantized weight (formats.py: q4_0, q4_1, q8_0; blocks of 32):

    y[m, n] = sum_b d_w[n, b] d_x[m, b] (q_w[n, b] . q_x[m, b]) + m_w[n, b] d_x[m, b] sum_j q_x[m, b, j]

with q_w the signed values (q4_0: q - 8) and m_w q4_1's minimum (0 for the other two): the
minimum multiplies the block's sum of x, which with quantized activations is d_x sum_j q_x
(llama.cpp's Q8_1 block sums). The dot products are integers, exact; this reference sums in
float64, so the kernels differ from it only in the order and rounding of their fp32 sums.
"""

from __future__ import annotations

import torch

from services.runtime.model.quant.formats import QuantizedWeight, unpack_values

BLOCK = 32
INT8_FORMATS = ("q4_0", "q4_1", "q8_0")
"""The formats the int8-activation kernels take: llama.cpp's, in blocks of 32."""
MIN_NORMAL = torch.finfo(torch.float32).tiny


def quantize_activations(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K] int8, d [M, K/block] fp32, block sums d * sum(q) [M, K/block] fp32).

    ``block``: 32 here, 256 for K-quant weights (kquant_act.py)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    amax = blocks.abs().amax(dim=-1)
    amax = torch.where(amax < MIN_NORMAL, torch.zeros_like(amax), amax)
    d = amax / 127
    # A true division, as the kernels' 127.0f / amax: torch computes ``127 / amax`` as 127 * (1 / amax),
    # rounded twice, which moves a product that should be exactly a half (23.5) off it.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    sums = d * q.sum(dim=-1)  # fp32: d times an integer of at most 32 * 127
    return q.to(torch.int8).reshape(m, k), d, sums


def int8_matmul_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] fp32 times the GGUF block-quantized ``w`` [N, K], x quantized as above -> [M, N] fp32."""
    if w.fmt not in INT8_FORMATS or w.group_size != BLOCK:
        raise ValueError(f"int8 activations take {', '.join(INT8_FORMATS)} weights in blocks of {BLOCK}; "
                         f"got {w.fmt} in groups of {w.group_size}")
    q, d, sums = quantize_activations(x)
    m, k = x.shape
    n, blocks = w.out_features, k // BLOCK
    values = unpack_values(w) - (8 if w.fmt == "q4_0" else 0)
    dots = torch.einsum("mbj,nbj->mnb", q.double().reshape(m, blocks, BLOCK),
                        values.double().reshape(n, blocks, BLOCK))  # exact: integers below 2^53
    y = (dots * d.double()[:, None, :] * w.scales.double()[None]).sum(dim=-1)
    if w.fmt == "q4_1":
        y = y + sums.double() @ w.mins.double().t()
    return y.float()
