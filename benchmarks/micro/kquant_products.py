"""A Q4_K_M file's products on one core, per instruction set: the K-quant and q5_0 blocks times
int8 activations (kquant_dot.cpp) against the same weights dequantized to fp32 (torch's matmul).

    python -m benchmarks kquant-products                 (one thread; CPU time of the thread)
    python -m benchmarks kquant-products --rows 1,8,32 --isas avx2,avx512_vnni

Shapes are Gemma 3 270M's (hidden 640, FFN 2048, 4 query heads and 1 KV head of 256) in the
types llama.cpp's Q4_K_M gives them: K = 640 is not a multiple of 256, so those projections are
Q5_0; o and down are Q4_K, with Q6_K for down in some layers. Each product is timed over
``--copies`` distinct weights (they stream from memory as a model's do), best of ``--repeats``
passes, as the thread's CPU time (time descheduled on a shared machine does not count).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.flags import setting

PROG = "python -m benchmarks kquant-products"
ISAS = ("portable", "avx2", "avx512_vnni")

SHAPES = ((1024, 640, "q5_0"), (256, 640, "q5_0"), (2048, 640, "q5_0"), (640, 1024, "q4_k"),
          (640, 2048, "q4_k"), (640, 2048, "q6_k"))
"""(out, in, format) of Gemma 3 270M's q, k (and v), gate (and up), o, down, down (Q4_K_M)."""


@dataclass(frozen=True, slots=True)
class KQuantSettings:
    rows: tuple[int, ...] = setting((1, 8, 32))
    """Input rows (tokens) per product, comma-separated."""
    isas: tuple[str, ...] = setting(())
    """Instruction sets to time (none: every one this CPU has but portable)."""
    copies: int = setting(8)
    """Distinct weights per shape."""
    repeats: int = setting(5)
    """Passes over the weights (the best is reported)."""

    def validate(self) -> None:
        if self.isas:
            flags.check_choices("isas", self.isas, ISAS)
        flags.check_at_least(self, 1, "copies", "repeats", *(() if self.rows else ("rows",)))
        if any(r < 1 for r in self.rows):
            raise ValueError(f"--rows must be at least 1, got {self.rows}")


def best_seconds(fn, calls: int, repeats: int) -> float:
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for c in range(calls):
            fn(c)
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(KQuantSettings, argv, prog=prog, description=__doc__)

    import numpy as np
    import torch

    from services.runtime.kernels import cpu
    from services.runtime.kernels.kquant_act import KQUANT_FORMAT_CODES, pack_tiles
    from services.runtime.model.quant.formats import QuantizedWeight, dequantize
    from services.tools.kquants import quantize_blocks

    torch.set_num_threads(1)
    ops = torch.ops.tokenmill_quant
    isas = list(args.isas) or [i for i in cpu.supported_isas() if i != "portable"]
    rng = np.random.default_rng(0)
    print(f"one thread, microseconds per product (thread CPU time), best of {args.repeats}; isas {isas}")
    print("fp32: the dequantized weight times x (torch.nn.functional.linear); ratio = fp32 / int8")
    for n, k, fmt in SHAPES:
        weights = [QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(
            quantize_blocks(rng.standard_normal((n, k)) * 0.05, fmt))}, 32) for _ in range(args.copies)]
        packed = [(pack_tiles(w), KQUANT_FORMAT_CODES[fmt], n, k) for w in weights]
        dense = [dequantize(w) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k)
            t_fp32 = best_seconds(lambda c: torch.nn.functional.linear(x, dense[c % len(dense)]), len(dense),
                                  args.repeats)
            cells = []
            for isa in isas:
                cpu.set_isa(isa)
                t = best_seconds(lambda c: ops.kquant_matmul(x, *packed[c % len(packed)]), len(packed), args.repeats)
                cells.append(f"{isa}: {t * 1e6:7.0f} ({t_fp32 / t:.2f}x)")
            print(f"{n:>5}x{k:<5} {fmt} rows {m:>3}:  fp32 {t_fp32 * 1e6:7.0f}  |  " + "  |  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
