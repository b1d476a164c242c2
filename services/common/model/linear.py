"""Linear layers, y = x W^T (+ b), with the weight prepacked for oneDNN when the model runs on a CPU.

On a CPU, F.linear calls MKL's sgemm, which repacks the weight into its blocked layout on
every call. A serving step multiplies a few dozen rows (the decode tokens plus a prefill
chunk) by each weight once, so that repacking is a large share of the step. Reordering the
weight once at load into oneDNN's layout and calling oneDNN's matmul removes it. Measured
on one core of the benchmark machine, all four projections of the 100M model's 12 layers:
1.46x faster at 32 rows, 1.36x at 66; with two threads 1.5-1.7x (MKL splits small products
across threads poorly). docs/benchmarks.md has the numbers. torch.compile's CPU backend and
IPEX prepack weights the same way for inference.

The packed weight replaces the plain one (no second copy), except for a tied LM head,
whose plain matrix is still the embedding table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PREPACK_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # A Parameter is kept as it is (a tied LM head shares the embedding's).
        self.weight: nn.Parameter | None = (
            weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Reorder the weight for oneDNN (CPU only); returns whether it did."""
        if self.packed is not None:
            return True
        if self.weight is None or not can_prepack(self.weight):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        del self.weight  # the Parameter: the packed copy replaces it
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, " \
               f"packed={self.packed is not None}"
