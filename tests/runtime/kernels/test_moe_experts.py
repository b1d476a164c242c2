"""The grouped quantized-experts CPU kernel (services/runtime/kernels/cpu/moe_experts.cpp) against its
PyTorch reference (services/runtime/kernels/moe_experts.py), on every instruction set this CPU runs
(and, through test_cpu_kernels_avx2.py, in a -march=haswell build).

Routings are awkward: no tokens at all, one token, top-1, top-2 with experts no token chose, top-8
of 8 (every expert takes every token), all tokens on one expert but one, 16 experts unevenly hit.
Formats: Q8_0 and Q4_K as GGUF files store experts, Q4_K_M's mix (Q4_K gate|up, Q6_K down), q4_1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.runtime.kernels import cpu
from services.runtime.kernels.moe_experts import (gate_up, moe_experts_int8, moe_experts_reference, pack_experts)
from services.runtime.kernels.fused_moe import fused_moe_reference
from services.runtime.model.quant.formats import QuantizedWeight, dequantize, quantize
from tests.helpers.kquants import quantize_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels cannot be built here")


@pytest.fixture(params=cpu.supported_isas() if cpu.available() else ("portable",))
def isa(request):
    previous = cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(previous)


def _weight(fmt: str, values: np.ndarray) -> QuantizedWeight:
    if fmt in ("q8_0", "q4_0", "q4_1"):
        return quantize(torch.from_numpy(values).float(), fmt)
    return QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(quantize_blocks(values, fmt))}, 32)


def _experts(num_experts: int, hidden: int, inter: int, fmt13: str, fmt2: str, seed: int):
    rng = np.random.default_rng(seed)
    w13 = [gate_up(_weight(fmt13, rng.standard_normal((inter, hidden)) * 0.1),
                   _weight(fmt13, rng.standard_normal((inter, hidden)) * 0.1)) for _ in range(num_experts)]
    w2 = [_weight(fmt2, rng.standard_normal((hidden, inter)) * 0.1) for _ in range(num_experts)]
    return w13, w2


def _routing(kind: str, tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    if kind == "skewed":  # every token on expert 3 (and one other slot), one token elsewhere too
        ids = torch.stack([torch.full((tokens,), 3), torch.full((tokens,), 5)], dim=1)
        ids[-1] = torch.tensor([0, 7])
    else:
        ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, ids.shape[1], generator=gen), dim=-1)
    return weights, ids


CASES = [  # (fmt13, fmt2, experts, hidden, inter, tokens, top_k, routing)
    ("q8_0", "q8_0", 4, 96, 64, 1, 1, "random"),
    ("q8_0", "q8_0", 8, 160, 96, 5, 2, "random"),  # at least three experts without tokens
    ("q8_0", "q8_0", 8, 96, 32, 13, 8, "random"),  # top-8 of 8: every expert takes every token
    ("q4_1", "q8_0", 8, 128, 64, 9, 2, "skewed"),
    ("q4_k", "q4_k", 4, 256, 256, 1, 2, "random"),
    ("q4_k", "q6_k", 16, 256, 256, 37, 2, "random"),  # Q4_K_M's mix, uneven counts
    ("q4_k", "q4_k", 8, 256, 256, 6, 2, "skewed"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-e{c[2]}-t{c[5]}-k{c[6]}-{c[7]}")
def test_grouped_quantized_experts_equal_the_reference(isa, case):
    fmt13, fmt2, num_experts, hidden, inter, tokens, top_k, kind = case
    w13, w2 = _experts(num_experts, hidden, inter, fmt13, fmt2, seed=hidden + tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = _routing(kind, tokens, num_experts, top_k, gen)
    out = moe_experts_int8(x, pack_experts(w13), fmt13, pack_experts(w2), fmt2, weights, ids, inter)
    expected = moe_experts_reference(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4)
    # Within int8 activations' rounding of the dequantized experts' fp32 result.
    dense = fused_moe_reference(x, torch.stack([dequantize(w) for w in w13]),
                                torch.stack([dequantize(w) for w in w2]), weights, ids)
    assert (out - dense).norm() <= 0.03 * dense.norm()


def test_no_tokens_and_bad_experts():
    w13, w2 = _experts(4, 96, 64, "q8_0", "q8_0", seed=0)
    p13, p2 = pack_experts(w13), pack_experts(w2)
    empty = moe_experts_int8(torch.zeros(0, 96), p13, "q8_0", p2, "q8_0", torch.zeros(0, 2),
                             torch.zeros(0, 2, dtype=torch.long), 64)
    assert empty.shape == (0, 96)
    with pytest.raises(RuntimeError, match="topk_ids holds expert 4; the layer has 4"):
        moe_experts_int8(torch.zeros(1, 96), p13, "q8_0", p2, "q8_0", torch.ones(1, 1), torch.tensor([[4]]), 64)
    with pytest.raises(RuntimeError, match="w2 format must be one of"):
        moe_experts_int8(torch.zeros(1, 96), p13, "q8_0", p2, "int8", torch.ones(1, 1), torch.tensor([[0]]), 64)
    with pytest.raises(RuntimeError, match="w13 must be"):
        moe_experts_int8(torch.zeros(1, 96), p13[:, 1:].contiguous(), "q8_0", p2, "q8_0", torch.ones(1, 1),
                         torch.tensor([[0]]), 64)
