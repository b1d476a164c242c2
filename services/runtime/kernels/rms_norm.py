"""Fused RMSNorm with an optional residual add (out of place).

  new_residual = x + residual                   (in x's dtype, as the unfused model adds)
  out = weight * (new_residual * rsqrt(mean(new_residual^2) + eps))

The sum of squares and the normalization run in fp32; the normalized row is rounded to the
input dtype before the weight multiply, which is Hugging Face LlamaRMSNorm's rounding.

Shapes: x, residual, out [T, hidden]; weight [hidden].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.runtime.kernels._common import FLOAT_DTYPES

_MAX_HIDDEN = 65536
"""One program holds a whole row in registers; beyond this it would spill."""


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    # 16-bit arithmetic is written as fp32 math rounded once, which is what torch computes
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + residual).to(dtype)  # the sum is rounded to the model dtype, as the unfused add does
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed [T, hidden], new_residual [T, hidden]).

    With ``residual`` the norm applies to x + residual, which comes back as new_residual.
    Without it new_residual is ``x`` itself (no copy), so a decoder layer can always write
    ``h, residual = rms_norm(h, w, eps, residual)``. ``out`` / ``residual_out`` are optional
    preallocated destinations (residual_out only with residual); they must not alias the inputs.
    """
    _check_inputs(x, weight, residual)
    num_rows, hidden = x.shape
    out = _destination(out, x, "out")
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out is only written when residual is given")
        new_residual = x
    else:
        new_residual = _destination(residual_out, x, "residual_out")
    if num_rows == 0:
        return out, new_residual
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out, new_residual,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), new_residual.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out, new_residual


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face LlamaRMSNorm (after the residual add the unfused model does)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def _destination(tensor: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if tensor is None:
        return torch.empty_like(like)
    if (tensor.shape != like.shape or tensor.dtype != like.dtype or tensor.device != like.device
            or tensor.stride(-1) != 1):
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device} with unit last stride, "
                         f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} strides {tensor.stride()}")
    return tensor


def _check_inputs(x, weight, residual) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, hidden] with unit last stride, got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size must be <= {_MAX_HIDDEN}, got {x.shape[1]}")
    if tuple(weight.shape) != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must match x ({x.dtype} on {x.device}), got {weight.dtype} on {weight.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"residual must be {tuple(x.shape)} with unit last stride, got "
                             f"{tuple(residual.shape)} strides {residual.stride()}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x ({x.dtype} on {x.device}), got "
                             f"{residual.dtype} on {residual.device}")
