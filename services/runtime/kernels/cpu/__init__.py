"""C++ kernels for the CPU path, compiled on first use with torch.utils.cpp_extension.

Decode attention over the paged cache is memory-bound on a CPU, and PyTorch cannot read a
block table without first copying the blocks out; ``paged_decode.cpp`` reads them in place.
It also holds the step's K/V write (both pools in one call) and the checks of block tables and
slots, each one pass that reports the first bad entry for Python to raise.
The build (about a minute, ``make install`` does it ahead of time) is cached per source,
flags and CPU, since it is compiled for the machine it runs on (``-march=native``), or for a
named ``-march`` (``TOKENMILL_CPU_KERNEL_MARCH``) when a container image builds it ahead of time.
A build directory the process cannot write (the image's, root-owned under a read-only root
filesystem) is loaded as it is, without torch's build step, which writes there.

``load()`` returns None when the kernels cannot be built here (no C++ compiler, say); the
caller falls back to the PyTorch path and says so. ``paged_decode_reference`` in
services/runtime/kernels/paged_decode.py is the reference both are tested against.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

from services.runtime.kernels._common import check_paged_attention_inputs, split_pool
from services.runtime.kernels.kv_quant import ScaledCache

# quant_matmul.cpp: the fp32 weight-only quantized matmul (services/runtime/model/quant/linear.py);
# quant_dot.cpp: the same weights times int8-quantized activations (services/runtime/kernels/quant_act.py);
# kquant_dot.cpp: GGUF K-quant and q5_0/q5_1 weights times int8 activations (services/runtime/kernels/kquant_act.py);
# fused_decode.cpp: a small model's whole decode step (services/runtime/model/fused_decode.py);
# shm_all_reduce.cpp: a CPU tensor-parallel group's all-reduce (services/runtime/parallel/shared_memory.py);
# lora.cpp: batched LoRA, each row its own adapter (services/runtime/kernels/lora.py);
# moe_experts.cpp: a sparse layer's quantized experts, grouped (services/runtime/kernels/moe_experts.py).
_SOURCES = [Path(__file__).with_name(name) for name in
            ("paged_decode.cpp", "quant_matmul.cpp", "quant_dot.cpp", "kquant_dot.cpp", "fused_decode.cpp",
             "shm_all_reduce.cpp", "lora.cpp", "moe_experts.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("paged_decode.h", "vec_exp.h", "cpu_isa.h", "quant_kernels.h",
                                                        "shm_all_reduce.h", "lora.h", "worker_pool.h")]
MARCH_ENV = "TOKENMILL_CPU_KERNEL_MARCH"
"""Overrides ``-march=native`` (e.g. ``haswell``: AVX2 without AVX-512). The tests build the
kernels for an AVX2-only CPU this way on any x86 machine, so the paths without AVX-512 run in
CI wherever it lands, not only on machines that lack it."""
ISA_ENV = "TOKENMILL_CPU_ISA"
"""Caps the instruction set of the quantized-weight kernels (``portable``, ``avx2`` or
``avx512_vnni``; default: the best the CPU has, read from cpuid at run time). Every path is in
every build, so an AVX-512 machine measures the AVX2 one with ``TOKENMILL_CPU_ISA=avx2``."""
ISAS = ("portable", "avx2", "avx512_vnni")
_CFLAGS = ["-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp"]
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
    """Unique per source, flags, CPU (under -march=native), torch and checkout, so a build never runs where
    it was not made for."""
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    if "-march=native" in _CFLAGS:
        # -march=native: the build fits this CPU alone. A named -march (a container image built
        # for a fleet) fits every CPU that has it, so the image's build is reused on any node.
        digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    # torch rebuilds a name whose build file names other source paths: two checkouts sharing
    # the build cache must not take turns rebuilding (and locking) one directory.
    digest.update(str(Path(__file__).resolve().parent).encode())
    return f"tokenmill_cpu_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an flock on the build while torch builds or loads it, and clear a stale baton.

    torch marks a build in progress with a plain ``lock`` file that only the builder removes: a
    build killed midway (Ctrl-C during ``make install``, an OOM kill) leaves it behind, and every
    later start then waits on it forever. The kernel drops an flock with its holder, so whoever
    holds this one knows no other process is building here and the baton, if any, is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".flock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


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
    name = build_name()
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # makes it if missing
    except OSError as exc:
        raise CpuKernelsUnavailable(f"could not build the CPU attention kernels: no build directory: {exc}") from exc
    prebuilt = build_dir / f"{name}{cpp_extension.LIB_EXT}"
    if not os.access(build_dir, os.W_OK):
        # A build directory this process cannot write is a finished build made ahead of time (the
        # image builds it, root-owned, under a read-only root filesystem): torch's load() would
        # write its ``lock`` baton and ninja's files there, so the library is loaded as it is.
        # Its name hashes the sources, flags and torch, so it is the build these sources need.
        if not prebuilt.is_file():
            raise CpuKernelsUnavailable(f"could not load the CPU attention kernels: {build_dir} is read-only and "
                                        f"holds no {prebuilt.name} (build them ahead of time with the same "
                                        f"{MARCH_ENV}, torch and checkout path, or make the directory writable)")
        torch.ops.load_library(str(prebuilt))
        return _loaded()
    try:
        with _build_lock(build_dir):
            cpp_extension.load(
                # Copies: torch appends its own flags to these lists, which would change
                # build_name() for the rest of the process.
                name=name, sources=[str(s) for s in _SOURCES], extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS), is_python_module=False, verbose=False,
            )
    except Exception as exc:  # compiler missing or failing: the reason goes to the caller
        raise CpuKernelsUnavailable(f"could not build the CPU attention kernels: {exc}") from exc
    return _loaded()


def _loaded() -> object:
    cap = os.environ.get(ISA_ENV)
    if cap:
        set_isa(cap)
    return torch.ops.tokenmill_cpu


def isa() -> str:
    """The instruction set the quantized-weight kernels run now (cpu_isa.h)."""
    load()
    return torch.ops.tokenmill_quant.cpu_isa()


def supported_isas() -> tuple[str, ...]:
    """Every instruction set this CPU can run, portable first."""
    load()
    best = torch.ops.tokenmill_quant.supported_cpu_isa()
    return ISAS[:ISAS.index(best) + 1]


def set_isa(name: str) -> str:
    """Run the quantized-weight kernels on ``name`` (one of ``ISAS`` the CPU has); returns the
    previous one. A process-wide setting: the tests run every path this way."""
    ops = torch.ops.tokenmill_quant
    previous = ops.cpu_isa()
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV} / cpu isa must be one of {', '.join(ISAS)}, got {name!r}")
    if not ops.set_cpu_isa(name):
        raise ValueError(f"this CPU cannot run {name!r} kernels: it supports up to {ops.supported_cpu_isa()!r}")
    return previous


def available() -> bool:
    try:
        load()
    except CpuKernelsUnavailable:
        return False
    return True


def check_paged_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Refuse inputs the kernel would misread, with a ValueError naming the field and the limit.

    The C++ kernel checks the same things, but an exception thrown there does not reach Python
    on every torch build (one build takes the process down with SIGSEGV instead), and the kernel
    reads raw pointers through the block table: bad input must be stopped here. A few vectorised
    ops over the tables, so a caller checks once per step, not once per layer.
    """
    # The shape, dtype and layout rules are the Triton launchers'; the lengths and block ids are
    # checked per sequence below, which is what keeps the kernel's raw reads inside the pool.
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, context_lens,
                                 num_seqs=q.shape[0] if q.dim() == 3 else -1, max_context_len=1)
    (k_data, k_scale), (v_data, v_scale) = split_pool(k_cache), split_pool(v_cache)
    if not (k_data.is_contiguous() and v_data.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and k_data.dtype != v_data.dtype):
        raise ValueError("k_cache and v_cache must both be plain or both quantized alike")
    check_block_tables(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every sequence's length fits its table, and every block it reads lies in the pool.

    One pass in C++ that reports the first bad entry instead of throwing (an exception thrown
    in C++ does not reach Python on every torch build); the error is raised here. A step's
    tables cost a few microseconds, where the same check in tensor ops cost ~40.
    """
    if context_lens.numel() == 0:
        return
    if block_tables.dim() != 2 or context_lens.dim() != 1 or context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"block_tables must be [B, max_blocks] with one of context_lens [B] per row, got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    tables = block_tables.cpu().to(torch.int32).contiguous()
    lens = context_lens.cpu().to(torch.int32).contiguous()
    b, j = load().find_bad_table_entry(tables, lens, num_blocks, block_size)
    if b < 0:
        return
    if j < 0:
        raise ValueError(f"context_lens[{b}] = {int(lens[b])} does not fit its block table: it must be >= 1 and "
                         f"need at most {tables.shape[1]} blocks of {block_size}")
    raise ValueError(f"block_tables[{b}][{j}] = {int(tables[b, j])} is outside the pool of {num_blocks} blocks")


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Every slot of ``slot_mapping`` lies in a pool of ``num_slots``; one C++ pass, raised here."""
    slots = slot_mapping.cpu().to(torch.int64).contiguous()
    bad = load().find_bad_slot(slots, num_slots)
    if bad >= 0:
        raise ValueError(f"slot_mapping[{bad}] = {int(slots[bad])} is outside the pool of {num_slots} slots")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, slots_checked: bool = False) -> None:
    """Store k, v [T, KH, D] at ``slot_mapping`` [T] int64 of the caches [NB, BS, KH, D], in one call.

    k and v need a unit last stride and the caches' dtype (any float dtype for quantized pools,
    kv_quant.ScaledCache, which get values and scales). ``slots_checked=True`` skips
    ``check_slots`` for a caller that ran it on this step's slots already.
    """
    if not slots_checked:
        check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    if isinstance(k_cache, ScaledCache):  # quantized by kv_quant's rule; k and v in any float dtype
        load().write_kv_quantized(k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, slot_mapping)
        return
    load().write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    inputs_checked: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention, one query per sequence, over the paged cache. q: [B, H, D] -> [B, H, D].
    ``window``: a sliding window of that many keys (the query and the ``window - 1`` before it).
    ``softcap``: scores ``softcap * tanh(s / softcap)`` after the scale (Gemma 2), None: uncapped.

    k/v cache: [num_blocks, block_size, KH, D], or quantized (kv_quant.ScaledCache); block_tables [B, max_blocks] and context_lens
    [B] are int32 (converted if not). Only the first ``context_lens[b]`` slots of a sequence's
    blocks are read. ``inputs_checked=True`` skips ``check_paged_decode_inputs`` for a caller
    that already ran it on these tables this step (the attention backend, once per step).
    """
    # Converted only when needed: at a decode step's size each call costs as much as the kernel.
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        context_lens = context_lens.to(torch.int32).contiguous()
    if not inputs_checked:
        check_paged_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    ops = load()
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty_like(q)
    if isinstance(k_cache, ScaledCache):
        ops.paged_decode_quantized(out, q, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, block_tables,
                                   context_lens, float(scale), int(window or 0), float(softcap or 0.0))
        return out
    ops.paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, float(scale), int(window or 0),
                     float(softcap or 0.0))
    return out


def main() -> int:
    """``python -m services.runtime.kernels.cpu``: build now (``make install`` calls it)."""
    try:
        load()
    except CpuKernelsUnavailable as exc:
        print(f"warning: {exc}; the CPU path will use PyTorch attention", file=sys.stderr)
        return 0
    print(f"CPU kernels ready ({build_name()}; quantized products on {isa()})")
    return 0
