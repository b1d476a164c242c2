"""SwiGLU activation of a fused gate/up projection: [T, 2F] -> [T, F].

  out = silu(x[:, :F]) * x[:, F:]

Rounded as the unfused Hugging Face MLP computes it: silu in fp32 rounded to x's dtype, then
the product in fp32 rounded to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES

_BLOCK = 1024
"""Columns per program: each program streams a 1024-wide slice of one row."""


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (activated * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2F] -> silu(x[:, :F]) * x[:, F:] as [T, F] (into ``out`` when given)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, 2 * intermediate] with unit last stride, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.shape[1] % 2:
        raise ValueError(f"x's last dimension must be even (gate and up halves), got {x.shape[1]}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    num_rows, width = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, width) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"out must be ({num_rows}, {width}) {x.dtype} on {x.device} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    if num_rows == 0 or width == 0:
        return out
    _silu_and_mul_kernel[(num_rows, triton.cdiv(width, _BLOCK))](
        x, out, x.stride(0), out.stride(0), width, BLOCK=_BLOCK, num_warps=4,
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
