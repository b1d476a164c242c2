"""The Triton dequantize-and-multiply kernel against its reference (dequantize, round to x's
dtype, matmul), over awkward shapes: one row, rows that are not a multiple of the tile, output
sizes not a multiple of 16 or of the tile, K not a multiple of the K tile, every format.

The kernel and the reference multiply the same rounded weights; they differ only in the order
of the fp32 accumulation and the final rounding, so the bound is one rounding step of the
output dtype relative to the output's scale (plus fp32 reordering)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, case_id, grid

from services.runtime.kernels.quant_matmul import quant_matmul, quant_matmul_reference
from services.runtime.model.quant.formats import quantize

ROUNDING_STEP = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.mark.parametrize("case", grid(
    strength=2, fmt=["q4_0", "q4_1", "q8_0", "int8"], dtype=list(DTYPES),
    rows=[1, 3, 17], out_features=[16, 40, 97], in_features=[32, 96, 160]), ids=case_id)
def test_quant_matmul_matches_reference(case, device):
    weight = torch.randn(case["out_features"], case["in_features"]) * 0.05
    w = quantize(weight, case["fmt"]).to(device)
    x = torch.randn(case["rows"], case["in_features"], device=device).to(case["dtype"])
    out = quant_matmul(x, w)
    expected = quant_matmul_reference(x, w)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert not out.isnan().any()
    scale = expected.float().abs().max().item()
    step = ROUNDING_STEP[case["dtype"]]
    torch.testing.assert_close(out.float(), expected.float(), atol=2 * step * scale, rtol=step)


def test_quant_matmul_row_stride_and_large_group(device):
    """x as a column slice of a wider buffer (row stride != K), and q4_1 with groups of 64."""
    weight = torch.randn(48, 128) * 0.02
    w = quantize(weight, "q4_1", group_size=64).to(device)
    wide = torch.randn(5, 200, device=device)
    x = wide[:, 10:138]
    torch.testing.assert_close(quant_matmul(x, w), quant_matmul_reference(x, w), atol=1e-5, rtol=1e-5)


def test_quant_matmul_rejects_mismatched_input(device):
    w = quantize(torch.randn(16, 64), "q8_0").to(device)
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        quant_matmul(torch.randn(2, 32, device=device), w)
    with pytest.raises(ValueError, match="dtype"):
        quant_matmul(torch.ones(2, 64, dtype=torch.int32, device=device), w)


@pytest.mark.gpu
def test_quant_linear_takes_the_triton_path_on_cuda():
    from services.runtime.model.quant.formats import dequantize
    from services.runtime.model.quant.linear import QuantLinear

    w = quantize(torch.randn(96, 128) * 0.05, "q4_1")
    layer = QuantLinear(w).to("cuda")
    assert layer.prepare() == "triton"
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    expected = (x.float() @ dequantize(w, torch.bfloat16).float().t().cuda()).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), expected, atol=2e-2, rtol=2**-7)
