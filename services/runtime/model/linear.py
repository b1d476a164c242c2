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

Whether the packed path works depends on the CPU as well as the dtype: oneDNN's bf16 path
needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT, and on an AVX2-only CPU the reorder or the first
product raises. So each dtype is probed once per process with one tiny reorder and product
(``packed_path_works``); a dtype whose probe fails keeps the plain F.linear path, and the
choice is logged once per dtype.

Small fp32 matrices stay on F.linear: oneDNN's call costs 15-30 µs whatever the size, which
for a matrix under a quarter of a million weights is more than MKL's whole product (a
64x64 weight times one row: 2.3 µs in MKL, 23 µs packed). One core of the benchmark
machine, plain / packed per call at 1, 8, 32 and 66 rows: 256x256 6/17, 18/36, 62/69, 95/94
µs; 512x512 50/46, 116/88, 366/247, 712/471 µs, and every larger shape wins from 512x512 on.
So fp32 weights prepack from ``PREPACK_MIN_ELEMENTS`` on. bf16 prepacks at every size: its
F.linear is oneDNN too (unpacked), and the packed call measured as fast or faster.
"""

from __future__ import annotations

import functools

import structlog
import torch
import torch.nn.functional as F
from torch import nn

PREPACK_DTYPES = (torch.float32, torch.bfloat16)
PREPACK_MIN_ELEMENTS = {torch.float32: 1 << 18, torch.bfloat16: 0}
"""Per dtype, the smallest weight (out x in elements) that ``worth_prepacking`` accepts."""

_log = structlog.get_logger("tokenmill.model")


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def packed_path_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs on this CPU in ``dtype``: one tiny reorder and product.

    Cached per dtype: the answer is a property of the CPU and the torch build, not of a weight.
    """
    if dtype not in PREPACK_DTYPES or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        reason = "oneDNN's prepacked linear is not in this torch build" if dtype in PREPACK_DTYPES \
            else "dtype not supported by oneDNN prepacking"
        _log.info("cpu linear path", dtype=str(dtype), path="plain", reason=reason)
        return False
    weight = torch.ones(4, 8, dtype=dtype)
    x = torch.ones(2, 8, dtype=dtype)
    try:
        out = _packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight), None)
        works = bool(torch.equal(out.float(), torch.full((2, 4), 8.0)))
        reason = "probe ran" if works else "probe gave a wrong product"
    except RuntimeError as exc:  # e.g. bf16 on a CPU without AVX-512: "bf16 path needs the cpu support ..."
        works, reason = False, str(exc).splitlines()[0]
    _log.info("cpu linear path", dtype=str(dtype), path="prepacked" if works else "plain", reason=reason)
    return works


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and packed_path_works(weight.dtype)


def worth_prepacking(weight: torch.Tensor) -> bool:
    """Whether the packed path is faster for this weight: large enough in fp32, any size in bf16."""
    return weight.numel() >= PREPACK_MIN_ELEMENTS.get(weight.dtype, 0)


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
            return _packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, " \
               f"packed={self.packed is not None}"
