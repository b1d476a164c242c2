"""The Triton kernel for GGUF's whole-block formats (services/runtime/kernels/kquant_matmul.py)
against its reference (gguf's dequantization, rounded to x's dtype, matmul), over awkward
shapes: one row and rows off the tile, output sizes off 16 and off the tile, one to three
blocks of 256 (q5_0/q5_1: 32, K off the K tile), every format, blocks of random bytes so every
bit pattern of values and packed scales is decoded. Runs in TRITON_INTERPRET=1 on a CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, case_id, grid

from services.runtime.kernels.kquant_matmul import kquant_matmul, kquant_matmul_reference
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from tests.helpers.kquants import random_blocks

ROUNDING_STEP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def weight(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    blocks = random_blocks(n, k, fmt, np.random.default_rng(seed))
    return QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(blocks)}, 32)


@pytest.mark.parametrize("case", grid(
    strength=2, fmt=["q4_k", "q5_k", "q6_k", "q5_0", "q5_1"], dtype=list(DTYPES),
    rows=[1, 17], out_features=[40, 97], blocks=[1, 3]), ids=case_id)
def test_kquant_matmul_matches_reference(case, device):
    k = case["blocks"] * (256 if case["fmt"].endswith("_k") else 32) + (0 if case["fmt"].endswith("_k") else 64)
    w = weight(case["fmt"], case["out_features"], k, seed=k).to(device)
    x = torch.randn(case["rows"], k, device=device).to(case["dtype"])
    out = kquant_matmul(x, w)
    expected = kquant_matmul_reference(x, w)
    assert out.shape == expected.shape and out.dtype == x.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    step = ROUNDING_STEP[case["dtype"]]
    torch.testing.assert_close(out.float(), expected.float(), atol=2 * step * scale, rtol=step)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q5_0", "q5_1"])
def test_decoded_weights_are_the_references(fmt, device):
    """x = the identity: the product is the decoded weight itself, equal to gguf's in fp32."""
    k = 256 if fmt.endswith("_k") else 64
    w = weight(fmt, 24, k, seed=7).to(device)
    got = kquant_matmul(torch.eye(k, device=device), w).t()
    torch.testing.assert_close(got, dequantize(w), atol=0, rtol=0) if device.type == "cpu" else \
        torch.testing.assert_close(got, dequantize(w), atol=1e-6, rtol=1e-6)


def test_kquant_matmul_rejects_mismatched_input(device):
    w = weight("q4_k", 16, 256, seed=1).to(device)
    with pytest.raises(ValueError, match="x has 128 features, the weight 256"):
        kquant_matmul(torch.randn(2, 128, device=device), w)
    with pytest.raises(ValueError, match="dtype"):
        kquant_matmul(torch.ones(2, 256, dtype=torch.int32, device=device), w)


@pytest.mark.gpu
def test_quant_linear_takes_the_triton_path_for_kept_blocks_on_cuda():
    from services.runtime.model.quant.linear import QuantLinear

    w = weight("q6_k", 40, 512, seed=3)
    layer = QuantLinear(w).to("cuda")
    assert layer.prepare() == "triton"
    x = torch.randn(5, 512, device="cuda")
    torch.testing.assert_close(layer(x), x @ dequantize(w).cuda().t(), atol=1e-4, rtol=1e-4)
