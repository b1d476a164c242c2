"""Kernel tests run on CUDA when there is one, else in Triton's interpreter on the CPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, i.e. when a kernel module
is first imported, so it is set here at import time, before any test module of this folder
imports services.runtime.kernels. If something collected earlier (another conftest or test
module) already imported a kernel module compiled for a GPU, the check below stops the run
with the fix rather than letting every kernel test fail obscurely.

The interpreter (triton 3.9) narrows fp32 to bfloat16 by truncation where GPUs round to
nearest even, which would double every bf16 rounding error here; ``_round_bf16_to_nearest``
patches that one conversion for the test session so bf16 tolerances mean the same on both.
Its float8 (e4m3) conversions are wrong too (fp32 -126.9 became -64); ``_float8_through_torch``
routes them through PyTorch's, which round to nearest even as the GPU's cvt.rn does.

TOKENMILL_FULL_KERNEL_GRID=1 runs the full cross-product grids (meant for a GPU); by default
a pairwise-covering subset keeps the interpreter run to about a minute on two cores.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.runtime.kernels import paged_decode  # noqa: E402  (after TRITON_INTERPRET on purpose)
from services.runtime.kernels._common import is_interpreted  # noqa: E402

if not _ON_GPU and not is_interpreted(paged_decode._paged_decode_partition_kernel):
    raise RuntimeError(
        "services.runtime.kernels was imported before tests/runtime/kernels/conftest.py could set TRITON_INTERPRET=1, "
        "so its kernels were built for a GPU this machine lacks. Set os.environ.setdefault('TRITON_INTERPRET', '1') "
        "when torch.cuda.is_available() is False at the top of tests/conftest.py, before any import of services."
    )



def _round_bf16_to_nearest() -> None:
    from triton.runtime import interpreter

    truncating_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == interpreter.tl.float32 and dst_type.scalar == interpreter.tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to even
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return truncating_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _float8_through_torch() -> None:
    from triton.runtime import interpreter

    tl = interpreter.tl
    fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        source, target = src.dtype.scalar, dst_type.scalar
        if target == tl.float8e4nv:
            wide = src if source == tl.float32 else self.cast_impl(src, tl.float32)
            values = torch.from_numpy(np.ascontiguousarray(wide.data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(values.view(torch.uint8).numpy(), target)
        if source == tl.float8e4nv:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.uint8))
            wide = interpreter.TensorHandle(bits.view(torch.float8_e4m3fn).float().numpy(), tl.float32)
            return wide if target == tl.float32 else self.cast_impl(wide, target)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


if not _ON_GPU:
    _round_bf16_to_nearest()
    _float8_through_torch()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if _ON_GPU else "cpu")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
