"""What batched LoRA adds to SmolLM2-135M's products on the CPU: the 30 layers' projections of a
step with and without the adapters' updates (services/runtime/kernels/lora.py's C++ kernel).

    python -m benchmarks lora-products                        (one thread; CPU time of the thread)
    python -m benchmarks lora-products --rows 1,32 --slots 8 --rank 16 --weights q4_1,fp32

Each layer holds SmolLM2's fused q|k|v, o, fused gate|up and down products (Q4_1 with int8
activations, as the shipped GGUF runs, or fp32 prepacked for oneDNN) and, for every one of the
seven target modules (q, k, v, o, gate, up, down), ``--slots`` random rank-``--rank`` adapters,
each distinct per layer, so the step streams them from memory as a server does. A fused
product's members share one call (``out_splits``: A stacked [S, k * R, in], B [S, out, R]
rank-major), so a layer makes four calls, each through a ``LoraStack`` checked once. A step's rows are spread round-robin over
the slots (32 rows over 8 slots: 4 rows each; one row: one adapter). The LM head's product (every row's logits, as in a decode step) is counted in the base. Times are the
thread's CPU time (time descheduled on a shared machine does not count), best of ``--repeats``.

"Products only": attention, norms and the sampler are left out, so the whole step's ratio is
closer to 1 than the ratio printed here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.flags import setting

PROG = "python -m benchmarks lora-products"
WEIGHTS = ("q4_1", "fp32")
ADAPTER_DTYPES = ("fp32", "bf16")

HIDDEN, INTERMEDIATE, KV_WIDTH, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
"""SmolLM2-135M: hidden size, MLP width, k and v width (3 KV heads of 64), layers, vocabulary."""

PRODUCTS = ((HIDDEN + 2 * KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
"""(out, in) of the layer's four products: q|k|v, o, gate|up, down."""
SPLITS = ((HIDDEN, KV_WIDTH, KV_WIDTH), (HIDDEN,), (INTERMEDIATE, INTERMEDIATE), (HIDDEN,))
"""Each product's target modules (their output widths): one lora_apply per product, with out_splits."""


@dataclass(frozen=True, slots=True)
class LoraProductsSettings:
    rows: tuple[int, ...] = setting((1, 32))
    """Rows (tokens) per step, comma-separated."""
    slots: int = setting(8)
    """Adapters resident (the rows are spread over them)."""
    rank: int = setting(16)
    """Rank of every adapter."""
    weights: tuple[str, ...] = setting(WEIGHTS)
    """Base weights: q4_1 (int8 activations), fp32 (prepacked)."""
    adapter_dtypes: tuple[str, ...] = setting(ADAPTER_DTYPES)
    """How the adapters are stored (computed in fp32 either way)."""
    repeats: int = setting(5)
    """Passes over the step (the best is reported)."""

    def validate(self) -> None:
        flags.check_choices("weights", self.weights, WEIGHTS)
        flags.check_choices("adapter_dtypes", self.adapter_dtypes, ADAPTER_DTYPES)
        flags.check_at_least(self, 1, "slots", "rank", "repeats")
        if not self.rows or any(r < 1 for r in self.rows):
            raise ValueError(f"--rows must be at least 1, got {self.rows}")


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def base_products(kind: str):
    """Per layer the four products as callables x -> y, and the head's."""
    import torch

    from services.runtime.model.linear import Linear
    from services.runtime.model.quant.formats import quantize
    from services.runtime.model.quant.linear import INT8_FORMAT_CODES

    ops = torch.ops.tokenmill_quant

    def make(out_features: int, in_features: int, fmt: str):
        weight = torch.randn(out_features, in_features) * 0.05
        if kind == "fp32":
            linear = Linear(weight)
            linear.prepack()
            return linear
        q = quantize(weight, fmt)
        code = INT8_FORMAT_CODES[fmt]
        mins = q.mins if q.mins is not None else torch.empty(0, dtype=torch.half)
        packed = ops.repack_int8(q.qweight, q.scales, mins, code)
        return lambda x: ops.quant_matmul_int8(x, packed, code, out_features, in_features)
    layers = [[make(n, k, "q4_1") for n, k in PRODUCTS] for _ in range(LAYERS)]
    return layers, make(VOCAB, HIDDEN, "q8_0")


def adapter_stacks(args: LoraProductsSettings, dtype):
    """Per layer and product a LoraStack: A [S, k * R, in], B the transposed view of [S, R, out]."""
    import torch

    from services.runtime.kernels import lora

    stacks = []
    for _ in range(LAYERS):
        layer = []
        for (out_features, in_features), splits in zip(PRODUCTS, SPLITS):
            a = (torch.randn(args.slots, len(splits) * args.rank, in_features) / in_features**0.5).to(dtype)
            b = (torch.randn(args.slots, args.rank, out_features) * 0.01).to(dtype).transpose(1, 2)
            layer.append(lora.LoraStack(a, b, torch.full((args.slots,), 2.0), splits))
        stacks.append(layer)
    return stacks


def products_step(layers, head, x: dict, slots, stacks) -> None:
    """A step's products, each followed by its adapters' updates when ``stacks`` is given."""
    for layer, layer_stacks in zip(layers, stacks or [None] * LAYERS):
        outs = [product(x[k]) for product, (_, k) in zip(layer, PRODUCTS)]
        if layer_stacks is None:
            continue
        for y, (_, in_features), stack in zip(outs, PRODUCTS, layer_stacks):
            stack.apply(y, x[in_features], slots)
    head(x[HIDDEN])  # a decode step: every row's logits


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(LoraProductsSettings, argv, prog=prog, description=__doc__)

    import torch

    from services.runtime.kernels import lora

    torch.set_num_threads(1)
    torch.manual_seed(0)
    assert lora._cpu_ops() is not None, "the C++ CPU kernels did not build"

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    all_stacks = {name: adapter_stacks(args, dtypes[name]) for name in args.adapter_dtypes}
    print(f"one thread, ms per step (thread CPU time), best of {args.repeats}; {args.slots} adapters of rank "
          f"{args.rank} on q,k,v,o,gate,up,down")
    for kind in args.weights:
        layers, head = base_products(kind)
        for rows in args.rows:
            x = {HIDDEN: torch.randn(rows, HIDDEN), INTERMEDIATE: torch.randn(rows, INTERMEDIATE)}
            slots = (torch.arange(rows) % args.slots).to(torch.int32)
            base = best_seconds(lambda: products_step(layers, head, x, slots, None), args.repeats)
            used = min(rows, args.slots)
            for name, stacks in all_stacks.items():
                with_lora = best_seconds(lambda: products_step(layers, head, x, slots, stacks), args.repeats)
                megabytes = sum(st.lora_a[:used].nbytes + st.lora_b[:used].nbytes for layer in stacks for st in layer) / 1e6
                print(f"{kind:>5} rows {rows:>3} over {used} {name} adapters ({megabytes:5.1f} MB): base "
                      f"{base * 1e3:7.2f}  + lora {with_lora * 1e3:7.2f} ms  (lora {(with_lora - base) * 1e3:6.2f} ms, "
                      f"{megabytes / 1e3 / max(with_lora - base, 1e-9):4.1f} GB/s)  base / with = {base / with_lora:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
