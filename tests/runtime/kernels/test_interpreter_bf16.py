"""The interpreter's fp32 -> bf16 narrowing rounds like torch (and the GPU) in this session."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _narrow_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets).to(tl.bfloat16))


def test_fp32_to_bf16_rounds_to_nearest_even(device):
    src = torch.randn(4096, device=device) * torch.logspace(-20, 20, 4096, device=device)
    src[:3] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan")])  # two ties, one NaN
    dst = torch.empty(4096, dtype=torch.bfloat16, device=device)
    _narrow_kernel[(1,)](src, dst, BLOCK=4096)
    torch.testing.assert_close(dst, src.to(torch.bfloat16), atol=0, rtol=0, equal_nan=True)
