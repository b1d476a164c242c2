"""C++ kernels for the CPU path, compiled on first use with torch.utils.cpp_extension.

Decode attention over the paged cache is memory-bound on a CPU, and PyTorch cannot read a
block table without first copying the blocks out; ``paged_decode.cpp`` reads them in place.
The build (about a minute, ``make install`` does it ahead of time) is cached per source,
flags and CPU, since it is compiled for the machine it runs on (``-march=native``).

``load()`` returns None when the kernels cannot be built here (no C++ compiler, say); the
caller falls back to the PyTorch path and says so. ``paged_decode_reference`` in
services/common/kernels/paged_decode.py is the reference both are tested against.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name("paged_decode.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


class CpuKernelsUnavailable(RuntimeError):
    pass


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """Unique per source, flags, CPU and torch, so a build never runs where it was not made for."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:12]}"


@functools.cache
def load() -> object:
    """Build (or reuse) and load the extension; returns ``torch.ops.tokenmill_cpu``.

    Raises CpuKernelsUnavailable with the reason when it cannot be built.
    """
    from torch.utils import cpp_extension

    # The ninja that pip installs sits beside this interpreter, which may not be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(
            name=build_name(), sources=[str(s) for s in _SOURCES], extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False,
        )
    except Exception as exc:  # compiler missing or failing: the reason goes to the caller
        raise CpuKernelsUnavailable(f"could not build the CPU attention kernels: {exc}") from exc
    return torch.ops.tokenmill_cpu


def available() -> bool:
    try:
        load()
    except CpuKernelsUnavailable:
        return False
    return True


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention, one query per sequence, over the paged cache. q: [B, H, D] -> [B, H, D].

    k/v cache: [num_blocks, block_size, KH, D]; block_tables [B, max_blocks] and context_lens
    [B] are int32 (converted if not). Only the first ``context_lens[b]`` slots of a sequence's
    blocks are read.
    """
    ops = load()
    q = q.contiguous()
    out = torch.empty_like(q)
    ops.paged_decode(
        out, q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(), float(scale),
    )
    return out


def main() -> int:
    """``python -m services.common.kernels.cpu``: build now (``make install`` calls it)."""
    try:
        load()
    except CpuKernelsUnavailable as exc:
        print(f"warning: {exc}; the CPU path will use PyTorch attention", file=sys.stderr)
        return 0
    print(f"CPU kernels ready ({build_name()})")
    return 0
