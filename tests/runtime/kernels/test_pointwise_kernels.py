"""RMSNorm (with and without the residual add), rotary embedding and SiLU-and-mul against
their references. These are elementwise up to a row reduction, so 16-bit outputs must agree
with the reference to within one rounding step of the dtype."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, FP32_TOLERANCE, case_id, grid, poisoned_like

from services.runtime.kernels.rms_norm import rms_norm, rms_norm_reference
from services.runtime.kernels.rotary import apply_rotary, rotary_reference
from services.runtime.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference

# one rounding step of the output dtype (relative), the fp32 reductions may differ in order
ROUNDING_STEP = {torch.float32: FP32_TOLERANCE, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _assert_within_one_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "unwritten (NaN) output elements"
    step = ROUNDING_STEP[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=step, rtol=step)


@pytest.mark.parametrize(
    "case", grid(strength=3, dtype=list(DTYPES), hidden=[64, 80, 1000, 4096], residual=[False, True]), ids=case_id)
def test_rms_norm(case, device):
    dtype, hidden = case["dtype"], case["hidden"]
    x = (3 * torch.randn(7, hidden, device=device)).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    residual = torch.randn(7, hidden, device=device).to(dtype) if case["residual"] else None
    out = poisoned_like(x)
    residual_out = poisoned_like(x) if case["residual"] else None
    normed, new_residual = rms_norm(x, weight, 1e-5, residual, out=out, residual_out=residual_out)
    expected, expected_residual = rms_norm_reference(x, weight, 1e-5, residual)
    assert normed is out
    _assert_within_one_rounding(normed, expected)
    if case["residual"]:
        assert new_residual is residual_out
        torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)  # the same one rounding
    else:
        assert new_residual is x


def test_rms_norm_strided_rows(device):
    x = torch.randn(5, 256, device=device)[:, :200]  # row stride 256, unit last stride
    weight = torch.randn(200, device=device)
    normed, _ = rms_norm(x, weight, 1e-6)
    _assert_within_one_rounding(normed, rms_norm_reference(x, weight, 1e-6)[0])


@pytest.mark.parametrize("case", grid(strength=3, dtype=list(DTYPES), head_dim=[64, 80, 128], gqa=[1, 4]), ids=case_id)
def test_rotary_in_place_on_fused_qkv_views(case, device):
    dtype, head_dim, gqa = case["dtype"], case["head_dim"], case["gqa"]
    tokens, kv_heads = 9, 2
    heads = gqa * kv_heads
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(4096, device=device).float(), inv_freq)  # [4096, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 1, 2, 17, 300, 301, 4095, 5, 1024], device=device)
    expected_q, expected_k = rotary_reference(q, k, positions, cos, sin)

    returned = apply_rotary(q, k, positions, cos, sin)

    assert returned[0] is q and returned[1] is k
    _assert_within_one_rounding(q, expected_q)
    _assert_within_one_rounding(k, expected_k)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before, atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("case", grid(strength=2, dtype=list(DTYPES), width=[64, 1000, 2048 + 3]), ids=case_id)
def test_silu_and_mul(case, device):
    dtype, width = case["dtype"], case["width"]
    x = (2 * torch.randn(6, 2 * width, device=device)).to(dtype)
    out = torch.full((6, width), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    _assert_within_one_rounding(out, silu_and_mul_reference(x))


def test_pointwise_launchers_reject_bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, torch.randn(32, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual_out is only written"):
        rms_norm(x, torch.randn(64, device=device), 1e-5, residual_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="last dimension must be even"):
        silu_and_mul(torch.randn(4, 63, device=device))
    with pytest.raises(ValueError, match="unit last stride"):
        silu_and_mul(x.t())
    q, k = torch.randn(3, 4, 64, device=device), torch.randn(3, 2, 64, device=device)
    table = torch.randn(16, 32, device=device)
    with pytest.raises(ValueError, match="positions must be contiguous int64"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int32, device=device), table, table)
    with pytest.raises(ValueError, match=r"cos must be \[max_position, 32\]"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int64, device=device), table[:, :16], table)
