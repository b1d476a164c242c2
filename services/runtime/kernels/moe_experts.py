"""A sparse layer's routed experts over quantized weights in their GGUF type (q4_0, q4_1, q8_0,
q4_k, q5_k, q6_k, q5_0, q5_1), on the CPU: the grouped C++ kernel
(services/runtime/kernels/cpu/moe_experts.cpp, ``torch.ops.tokenmill_quant.moe_experts_int8``),
how its weights are packed, and its PyTorch reference.

Each expert's gate|up weight [2I, H] and down weight [H, I] are repacked once at load into the
int8-activation kernels' tiles (quant_dot.cpp's for q4_0/q4_1/q8_0, kquant_act.pack_tiles' for
the others), stacked per projection as [E, bytes per expert]. The kernel's arithmetic is those
products' (inputs rounded to int8 per 32 values, quant_act.py); the reference is the same
per expert in PyTorch: ``int8_matmul_reference`` / ``kquant_matmul_reference`` (the weight
dequantized, the input rounded as the kernel rounds it, the product summed in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.runtime.kernels.kquant_act import KQUANT_FORMAT_CODES, kquant_matmul_reference, pack_tiles
from services.runtime.kernels.quant_act import int8_matmul_reference
from services.runtime.model.quant.formats import QuantizedWeight, cat_rows

INT8_FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
"""quant_dot.cpp's QuantFormat."""
FORMATS = (*INT8_FORMAT_CODES, *KQUANT_FORMAT_CODES)


def experts_fit(weights: list[QuantizedWeight]) -> bool:
    """Whether the kernel takes these experts' weights of one projection (one format, blocks it reads)."""
    first = weights[0]
    if any((w.fmt, w.shape) != (first.fmt, first.shape) for w in weights):
        return False
    if first.fmt in INT8_FORMAT_CODES:
        return first.group_size == 32 and first.in_features % 32 == 0
    return first.fmt in KQUANT_FORMAT_CODES


def pack_one(w: QuantizedWeight) -> torch.Tensor:
    """One expert's weight as its kernel's tiles, uint8 [bytes] (the C++ extension must be loaded)."""
    if w.fmt in KQUANT_FORMAT_CODES:
        return pack_tiles(w)
    mins = w.mins if w.mins is not None else torch.empty(0, dtype=torch.float16)
    return torch.ops.tokenmill_quant.repack_int8(w.qweight, w.scales, mins, INT8_FORMAT_CODES[w.fmt])


def pack_experts(weights: list[QuantizedWeight]) -> torch.Tensor:
    """The experts' weights of one projection -> [E, bytes per expert] uint8."""
    return torch.stack([pack_one(w) for w in weights])


def gate_up(gate: QuantizedWeight, up: QuantizedWeight) -> QuantizedWeight:
    """One expert's gate and up weights as the [2I, H] weight the kernel multiplies by (gate rows first)."""
    return cat_rows([gate, up])


def moe_experts_int8(x: torch.Tensor, w13: torch.Tensor, fmt13: str, w2: torch.Tensor, fmt2: str,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, inter: int) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype through the C++ kernel (packed ``w13`` [E, .], ``w2`` [E, .])."""
    out = torch.ops.tokenmill_quant.moe_experts_int8(
        x.float().contiguous(), w13, fmt13, w2, fmt2, topk_weights.float().contiguous(),
        topk_ids.long().contiguous(), inter)
    return out.to(x.dtype)


def _product(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if w.fmt in KQUANT_FORMAT_CODES:
        return kquant_matmul_reference(x, w)
    return int8_matmul_reference(x, w)


def moe_experts_reference(x: torch.Tensor, w13: list[QuantizedWeight], w2: list[QuantizedWeight],
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The kernel's numbers per expert in PyTorch: each expert's rows through its two int8-activation
    products (dequantized weight, rounded input), silu(gate) * up between, weighted and summed per token."""
    x = x.float()
    t, k = topk_ids.shape
    out = torch.zeros_like(x)
    for e in range(len(w13)):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate, up = _product(x[tokens], w13[e]).chunk(2, dim=-1)
        y = _product(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
    return out
