"""QuantLinear: y = x W^T with W held quantized (formats.py), one path per device and format.

CPU (``prepare`` picks once, at load; measured on one core of the 2-core benchmark machine,
a 3072x576 weight, 30 distinct copies so that the weights stream from memory as a model's do):

===========  =====================================================  ==============  ===============
format       path                                                   1 row           32 rows
===========  =====================================================  ==============  ===============
q4_0, q4_1   aten._weight_int4pack_mm_for_cpu (bf16 activations)    103 us          1358 us
int8         aten._weight_int8pack_mm (bf16 activations)            371 us          1877 us
q8_0         dequantized once to bf16, oneDNN prepacked (linear.py)  248 us           739 us
(fp32 ref.)  oneDNN prepacked fp32                                  551 us          1381 us
===========  =====================================================  ==============  ===============

Both aten operators are vectorized only for bf16 activations (fp32: 3.1 ms and 1.5 ms at one
row, 10-100x slower at 32), so x is rounded to bf16 on the way in and the product (accumulated
in fp32 by the operators) is rounded to bf16 on the way out, then cast back to x's dtype.
That rounding is the whole difference from the dequantized model's numbers: the tests bound
it. The int4 operator's weight is ``(q - 8) * scale + zero`` per group, so Q4_1's ``d * q + m``
is ``scale = d, zero = m + 8 d`` and Q4_0's ``d (q - 8)`` is ``zero = 0``; it needs the output
size to be a multiple of 16, the int8 one the input size (other sizes crash it). torch has no group-wise int8 operator on a CPU, so q8_0 (and any
weight an operator does not take) runs dequantized in bf16 through the prepacked Linear.

CUDA: the Triton dequantize-and-multiply kernel (kernels/quant_matmul.py) reads the stored
parts as they are, in the activations' dtype.
"""

from __future__ import annotations

import structlog
import torch
from torch import nn

from services.runtime.model.linear import Linear
from services.runtime.model.quant.formats import QuantizedWeight, cat_rows, dequantize, unpack_values

CPU_COMPUTE_DTYPE = torch.bfloat16
INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes aten's CPU int4 operator accepts."""

_log = structlog.get_logger("tokenmill.model")


def int4_cpu_fits(w: QuantizedWeight) -> bool:
    return w.fmt in ("q4_0", "q4_1") and w.out_features % 16 == 0 and w.group_size in INT4_CPU_GROUP_SIZES


def pack_int4_cpu(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale-and-zero [K/G, N, 2] bf16) for aten._weight_int4pack_mm_for_cpu."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_values(w), 1)
    d = w.scales.float()
    zero = w.mins.float() + 8 * d if w.fmt == "q4_1" else torch.zeros_like(d)
    scale_zero = torch.stack([d.t(), zero.t()], dim=-1).to(CPU_COMPUTE_DTYPE).contiguous()
    return packed, scale_zero


class QuantLinear(nn.Module):
    """A projection whose weight stays quantized; ``prepare()`` (after moving) readies the device's path."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.quantized = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.path = "unprepared"
        self._packed: torch.Tensor | None = None
        self._scale_zero: torch.Tensor | None = None
        self._int8_scales: torch.Tensor | None = None
        self._fallback: Linear | None = None

    def _apply(self, fn, recurse: bool = True):
        # nn.Module.to() moves Parameters and buffers; the quantized parts move with it.
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0, device=self.quantized.device))
        if probe.device != self.quantized.device:
            self.quantized = self.quantized.to(probe.device)
            self.path = "unprepared"
        return self

    def prepare(self) -> str:
        """Choose and build this device's path (see the module docstring); returns its name."""
        w = self.quantized
        if w.device.type == "cuda":
            self.path = "triton"
        elif int4_cpu_fits(w):
            self._packed, self._scale_zero = pack_int4_cpu(w)
            self.path = "int4pack"
        elif w.fmt == "int8" and w.in_features % 16 == 0:  # the operator reads K in 16s (crashes otherwise)
            self._packed = w.qweight.contiguous()
            self._int8_scales = w.scales.to(CPU_COMPUTE_DTYPE)
            self.path = "int8pack"
        else:
            self._fallback = Linear(dequantize(w, CPU_COMPUTE_DTYPE))
            self._fallback.prepack()
            self.path = "dequantized"
        if self.path in ("int4pack", "int8pack", "dequantized"):
            # The CPU paths keep their own copy; the stored parts are no longer read.
            self.quantized = QuantizedWeight(w.fmt, w.out_features, w.in_features, w.group_size,
                                             w.qweight[:0], w.scales[:0], None if w.mins is None else w.mins[:0])
        return self.path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        if self.path == "unprepared":
            self.prepare()
        if self.path == "triton":
            from services.runtime.kernels.quant_matmul import quant_matmul

            out = quant_matmul(x, self.quantized)
        else:
            xc = x.to(CPU_COMPUTE_DTYPE)
            if self.path == "int4pack":
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self._packed, self.quantized.group_size,
                                                                  self._scale_zero)
            elif self.path == "int8pack":
                out = torch.ops.aten._weight_int8pack_mm(xc, self._packed, self._int8_scales)
            else:
                out = self._fallback(xc)
            out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        w = self.quantized
        return f"in={self.in_features}, out={self.out_features}, format={w.fmt}, group={w.group_size}, " \
               f"path={self.path}, bias={self.bias is not None}"


def build_linear(weights: list[torch.Tensor | QuantizedWeight], bias: torch.Tensor | None = None
                 ) -> Linear | QuantLinear:
    """One projection from weights stacked along the output axis (q|k|v, gate|up), quantized or not.

    A group mixing float and quantized weights (a ``modules`` exception inside a fused
    projection) runs in float: the quantized members are dequantized to the float one's dtype.
    """
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    if not quantized:
        # A single weight is kept as it is (a tied LM head shares the embedding's Parameter).
        return Linear(weights[0] if len(weights) == 1 else torch.cat(weights), bias)
    if len(quantized) == len(weights):
        return QuantLinear(cat_rows(quantized), bias)
    dtype = next(w.dtype for w in weights if not isinstance(w, QuantizedWeight))
    return Linear(torch.cat([dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w for w in weights]), bias)
