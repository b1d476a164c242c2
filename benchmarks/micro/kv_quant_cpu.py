"""The C++ CPU kernels over a quantized KV pool (int8, fp8 e4m3) against the same kernels over an fp32 pool.

    python -m benchmarks kv-quant-cpu [--seqs 16] [--context 1024] [--heads 9] [--kv-heads 3]
        [--head-dim 64] [--repeats 7]

Times ``paged_decode`` (one query per sequence over its whole context) and a 16-token
``write_kv`` for each pool, interleaved round by round so the machine's load falls on all of them
alike; prints the medians and their ratio to the fp32 pool. Defaults: SmolLM2-135M's attention
shape. Run with OMP_NUM_THREADS=1 for one thread's figures.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.kv_quant import KV_CACHE_DTYPES, ScaledCache, write_quantized


PROG = "python -m benchmarks kv-quant-cpu"


@dataclass(frozen=True, slots=True)
class KvQuantCpuSettings:
    seqs: int = setting(16)
    """Sequences, one query each."""
    context: int = setting(1024)
    """Context of every sequence."""
    heads: int = setting(9)
    """Query heads (SmolLM2-135M's by default)."""
    kv_heads: int = setting(3)
    """KV heads."""
    head_dim: int = setting(64)
    """Head dimension."""
    block_size: int = setting(16)
    """Tokens per KV block."""
    repeats: int = setting(7)
    """Interleaved rounds (the median is printed)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "seqs", "context", "heads", "kv_heads", "head_dim", "block_size", "repeats")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(KvQuantCpuSettings, argv, prog=prog, description=__doc__)
    torch.manual_seed(0)
    b, bs, kh, d = args.seqs, args.block_size, args.kv_heads, args.head_dim
    num_blocks = b * -(-args.context // bs)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), args.context, dtype=torch.int32)
    k = torch.randn(num_blocks * bs, kh, d)
    v = torch.randn(num_blocks * bs, kh, d)
    q = torch.randn(b, args.heads, d)
    pools = {"fp32": (k.view(num_blocks, bs, kh, d).clone(), v.view(num_blocks, bs, kh, d).clone())}
    for name, dtype in KV_CACHE_DTYPES.items():
        k_pool, v_pool = (ScaledCache.empty((num_blocks, bs, kh, d), dtype, torch.device("cpu")) for _ in range(2))
        write_quantized(k, v, k_pool, v_pool, torch.arange(num_blocks * bs))
        pools[name] = (k_pool, v_pool)
    slots = torch.randperm(num_blocks * bs)[:16]
    new_k, new_v = torch.randn(16, kh, d), torch.randn(16, kh, d)
    decode: dict[str, list[float]] = {name: [] for name in pools}
    write: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(args.repeats):
        for name, (k_pool, v_pool) in pools.items():
            start = time.perf_counter()
            for _ in range(10):
                cpu_kernels.paged_decode(q, k_pool, v_pool, tables, lens, d**-0.5)
            decode[name].append((time.perf_counter() - start) / 10)
            start = time.perf_counter()
            for _ in range(100):
                cpu_kernels.write_kv(new_k, new_v, k_pool, v_pool, slots)
            write[name].append((time.perf_counter() - start) / 100)
    report = {}
    for name in pools:
        report[name] = {
            "decode_ms": 1e3 * statistics.median(decode[name]),
            "decode_vs_fp32": statistics.median(decode[name]) / statistics.median(decode["fp32"]),
            "write_16_tokens_us": 1e6 * statistics.median(write[name]),
            "pool_mib": sum(x.nbytes for x in pools[name]) / 2**20,
        }
    print(json.dumps({"threads": torch.get_num_threads(), **asdict(args), "results": report}, indent=1))
    return 0
