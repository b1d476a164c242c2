"""The C++ CPU paged decode kernel of this checkout against the same kernel at another revision, in one run.

    python -m benchmarks cpu-paged-decode [--baseline 3f093b1~1] [--shapes 8:4:8,9:3:64]
        [--batches 1,8,32,64] [--contexts 16,100,1024] [--threads 1,2] [--repeats 7] [--dtype float32]

The baseline's paged_decode.cpp (``git show REV:...``) is built beside this checkout's kernels
under a renamed op library (``tokenmill_cpu_baseline``), so both run in the same process on the
same tensors: for every shape (query heads, kv heads, head dim; block size 16), batch, context
and thread count the two are timed in alternation, ``--repeats`` rounds, and the median of each
is printed with baseline / current (> 1: the current kernel is faster) and the largest output
difference. Contexts are drawn in [3/4 context, context] per sequence, block ids shuffled.
Configurations whose K pool would exceed --max-pool-mib are skipped (a shared machine's memory).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import REPO_ROOT as REPO
from services.runtime.kernels import cpu as cpu_kernels

PROG = "python -m benchmarks cpu-paged-decode"
DTYPES = ("float32", "bfloat16", "float16")
KERNEL = "services/runtime/kernels/cpu/paged_decode.cpp"
HEADER = "services/runtime/kernels/cpu/paged_decode.h"
BASELINE_LIB = "tokenmill_cpu_baseline"


def git_show(rev: str, path: str) -> str | None:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None


def load_baseline(rev: str) -> object:
    """Builds the baseline's paged_decode.cpp alone, its op library and C++ namespace renamed."""
    from torch.utils import cpp_extension

    source = git_show(rev, KERNEL)
    if source is None:
        raise SystemExit(f"{KERNEL} does not exist at {rev}")
    header = git_show(rev, HEADER)
    digest = hashlib.sha256((source + (header or "") + " ".join(cpu_kernels._CFLAGS)).encode()).hexdigest()[:12]
    build_dir = Path(tempfile.gettempdir()) / f"tokenmill_paged_decode_baseline_{digest}"
    build_dir.mkdir(exist_ok=True)
    files = {"paged_decode.cpp": source, "paged_decode.h": header}
    for name, text in files.items():
        path = build_dir / name
        if text is not None and (not path.exists() or path.read_text() != text.replace("tokenmill_cpu", BASELINE_LIB)):
            path.write_text(text.replace("tokenmill_cpu", BASELINE_LIB))
    bin_dir = str(Path(sys.executable).parent)  # pip's ninja sits beside the interpreter
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cpp_extension.load(name=f"{BASELINE_LIB}_{digest}", sources=[str(build_dir / "paged_decode.cpp")],
                       extra_cflags=cpu_kernels._CFLAGS, extra_ldflags=cpu_kernels._LDFLAGS,
                       build_directory=str(build_dir), is_python_module=False, verbose=False)
    return getattr(torch.ops, BASELINE_LIB)


def time_call(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


@dataclass(frozen=True, slots=True)
class CpuPagedDecodeSettings:
    baseline: str = setting("3f093b1~1")
    """Git revision of the kernel to compare against."""
    shapes: tuple[str, ...] = setting(("8:4:8", "8:4:16", "8:4:32", "9:3:64", "32:8:128"))
    """Query heads:kv heads:head dim, comma-separated."""
    batches: tuple[int, ...] = setting((1, 8, 32, 64))
    """Batch sizes, comma-separated."""
    contexts: tuple[int, ...] = setting((16, 100, 1024))
    """Longest context of a sequence, comma-separated."""
    threads: tuple[int, ...] = setting((1, 2))
    """torch threads, comma-separated."""
    repeats: int = setting(7)
    """Interleaved rounds (the median is printed)."""
    dtype: str = setting("float32", choices=DTYPES)
    """Data type of the pools and queries."""
    block_size: int = setting(16)
    """Tokens per KV block."""
    max_pool_mib: float = setting(64.0)
    """Skip configurations whose K pool is larger."""

    def validate(self) -> None:
        flags.check_choices("dtype", self.dtype, DTYPES)
        flags.check_at_least(self, 1, "repeats", "block_size")
        bad = [s for s in self.shapes if len(s.split(":")) != 3 or not all(p.isdigit() for p in s.split(":"))]
        if bad:
            raise ValueError(f"--shapes: expected HEADS:KV_HEADS:HEAD_DIM, got {', '.join(bad)}")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(CpuPagedDecodeSettings, argv, prog=prog, description=__doc__)
    baseline = load_baseline(args.baseline)
    current = cpu_kernels.load()
    dtype = getattr(torch, args.dtype)
    bs = args.block_size
    print(f"baseline {args.baseline} vs this checkout, {args.dtype}, block size {bs}, median of {args.repeats} "
          "interleaved rounds (us per call)")
    print("| heads/kv/dim | batch | context | threads | baseline us | current us | baseline/current | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, batch, context, threads in itertools.product(args.shapes, args.batches, args.contexts, args.threads):
        heads, kv_heads, head_dim = map(int, shape.split(":"))
        per_seq = -(-context // bs)
        num_blocks = batch * per_seq + 1
        if num_blocks * bs * kv_heads * head_dim * dtype.itemsize / 2**20 > args.max_pool_mib:
            continue
        torch.manual_seed(0)
        torch.set_num_threads(threads)
        tables = (torch.randperm(num_blocks - 1)[: batch * per_seq] + 1).int().view(batch, per_seq)
        lens = torch.randint(max(1, context * 3 // 4), context + 1, (batch,), dtype=torch.int32)
        k = torch.randn(num_blocks, bs, kv_heads, head_dim).to(dtype)
        v = torch.randn(num_blocks, bs, kv_heads, head_dim).to(dtype)
        q = torch.randn(batch, heads, head_dim).to(dtype)
        outs = {"baseline": torch.empty_like(q), "current": torch.empty_like(q)}
        calls = {name: functools.partial(ops.paged_decode, outs[name], q, k, v, tables, lens, head_dim**-0.5)
                 for name, ops in (("baseline", baseline), ("current", current))}
        for fn in calls.values():
            fn()
        inner = max(1, int(0.002 / max(time_call(calls["baseline"], 1), 1e-7)))  # ~2 ms a measurement
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                times[name].append(time_call(fn, inner))
        base, cur = (1e6 * statistics.median(times[name]) for name in ("baseline", "current"))
        diff = (outs["baseline"].float() - outs["current"].float()).abs().max().item()
        print(f"| {heads}/{kv_heads}/{head_dim} | {batch} | {context} | {threads} | {base:.1f} | {cur:.1f} | "
              f"{base / cur:.2f} | {diff:.1e} |", flush=True)
    return 0
