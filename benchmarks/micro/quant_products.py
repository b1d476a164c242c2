"""SmolLM2's quantized products on one core, per instruction set: int8 activations against the
exact kernel and the dequantized panels (the numbers behind --quant-activations' default).

    python -m benchmarks quant-products                 (one thread; CPU time of the thread)
    python -m benchmarks quant-products --rows 1,8,32 --isas avx2,avx512_vnni

Each product is timed over ``--copies`` distinct weights of its shape (so they stream from memory
as a model's do, not from cache), best of ``--repeats`` passes, as the thread's CPU time: on a
machine other jobs share, time spent descheduled does not count. Also times the 30 layers of
SmolLM2 at one row (66 MB of Q4_1 weights, the memory-bound decode case).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.flags import setting

PROG = "python -m benchmarks quant-products"
ISAS = ("portable", "avx2", "avx512_vnni")

SHAPES = ((960, 576, "q4_1"), (576, 576, "q4_1"), (3072, 576, "q4_1"), (576, 1536, "q4_1"), (49152, 576, "q8_0"))
"""(out, in, format) of SmolLM2-135M's q|k|v, o, gate|up, down and its tied Q8_0 head."""


@dataclass(frozen=True, slots=True)
class ProductsSettings:
    rows: tuple[int, ...] = setting((1, 8, 32))
    """Input rows (tokens) per product, comma-separated."""
    isas: tuple[str, ...] = setting(())
    """Instruction sets to time (none: every one this CPU has but portable)."""
    copies: int = setting(8)
    """Distinct weights per shape (2 for the head)."""
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
    args = flags.parse(ProductsSettings, argv, prog=prog, description=__doc__)

    import torch

    from services.runtime.kernels import cpu
    from services.runtime.model.quant.formats import bits, quantize
    from services.runtime.model.quant.linear import INT8_FORMAT_CODES, cpu_kernel_operands, panel_columns

    torch.set_num_threads(1)
    ops = torch.ops.tokenmill_quant
    isas = list(args.isas) or [i for i in cpu.supported_isas() if i != "portable"]
    rows = list(args.rows)
    print(f"one thread, microseconds per product (thread CPU time), best of {args.repeats}; isas {isas}")
    for n, k, fmt in SHAPES:
        weights = [quantize(torch.randn(n, k) * 0.05, fmt) for _ in range(args.copies if n < 10_000 else 2)]
        exact = [(w.qweight, *cpu_kernel_operands(w)[:2], bits(fmt), cpu_kernel_operands(w)[2]) for w in weights]
        no_mins = torch.empty(0, dtype=torch.half)
        packed = [(ops.repack_int8(w.qweight, w.scales, w.mins if w.mins is not None else no_mins,
                                   INT8_FORMAT_CODES[fmt]), INT8_FORMAT_CODES[fmt], n, k) for w in weights]
        for m in rows:
            x = torch.randn(m, k)
            cells = []
            for isa in isas:
                cpu.set_isa(isa)
                t_int8 = best_seconds(lambda c: ops.quant_matmul_int8(x, *packed[c % len(packed)]), len(packed),
                                      args.repeats)
                t_exact = best_seconds(lambda c: ops.quant_matmul(x, *exact[c % len(exact)]), len(exact), args.repeats)
                cells.append(f"{isa}: int8 {t_int8 * 1e6:7.0f}  exact {t_exact * 1e6:7.0f}  ({t_exact / t_int8:.1f}x)")
            t_panels = best_seconds(lambda c: ops.quant_matmul_panels(x, *exact[c % len(exact)], panel_columns(k)),
                                    len(exact), args.repeats)
            print(f"{n:>6}x{k:<5} {fmt} rows {m:>3}:  " + "  |  ".join(cells) + f"  |  panels {t_panels * 1e6:7.0f}")
    layers = []
    for _ in range(30):
        for n, k, fmt in SHAPES[:4]:
            w = quantize(torch.randn(n, k) * 0.05, fmt)
            code = INT8_FORMAT_CODES[fmt]
            layers.append((ops.repack_int8(w.qweight, w.scales, w.mins, code), code, n, k))
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    megabytes = sum(t.numel() for t, *_ in layers) / 1e6
    for isa in isas:
        cpu.set_isa(isa)
        seconds = best_seconds(lambda _: [ops.quant_matmul_int8(xs[k], t, f, n, k) for t, f, n, k in layers], 1,
                               args.repeats)
        print(f"30 layers at one row, {isa}: {seconds * 1e3:.2f} ms for {megabytes:.0f} MB "
              f"({megabytes / 1e3 / seconds:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
