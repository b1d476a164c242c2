"""Steps with prompt tokens: the fused CPU step against the eager forward, by the step's size.

    python -m benchmarks fused-step [--model models/stories260K] [--threads 1] [--rounds 41]

For each shape the ModelRunner's forward runs the same step both ways, interleaved round by
round on one KV pool (``FusedDecode`` with every size allowed, and ``model(...)``): a lone
prompt of N tokens, and the same prompt beside seven decode rows of context 64 (a request
arriving into a running batch). Prints the median milliseconds of each and fused / eager,
which is where ``--cpu-fused-max-tokens`` should stop: the fused step reads each row's context
again, so its attention grows with the square of the prompt, while the eager step pays ~170
dispatched operations whatever the size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import STORIES
from benchmarks.harness.report import cpu_model_name
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner
from services.runtime.step_inputs import pack_step_inputs

PROG = "python -m benchmarks fused-step"
BLOCK_SIZE = 16
DECODE_CONTEXT = 64


def step(runner: ModelRunner, contexts: list[int], query_lens: list[int]):
    """Inputs of a step whose sequence i computes its last query_lens[i] of contexts[i] tokens."""
    tables, next_block = [], 0
    for n in contexts:
        width = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + width)))
        next_block += width
    positions = [p for n, q in zip(contexts, query_lens) for p in range(n - q, n)]
    row_tables = [t for t, q in zip(tables, query_lens) for _ in range(q)]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(row_tables, positions)]
    ids = [3 + (7 * i) % 200 for i in range(len(positions))]
    return pack_step_inputs(ids, positions, slots, query_lens, contexts, tables, BLOCK_SIZE, runner.device)


def time_ms(fn, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


@dataclass(frozen=True, slots=True)
class FusedStepSettings:
    model: str = setting(str(STORIES))
    """Model directory (one the fused CPU step takes)."""
    threads: int = setting(1)
    """torch intra-op threads."""
    rounds: int = setting(41)
    """Timed rounds of each shape, fused and eager interleaved."""
    sizes: tuple[int, ...] = setting((1, 4, 8, 16, 32, 48, 64, 96, 128, 256))
    """Prompt lengths, comma-separated."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "threads", "rounds")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(FusedStepSettings, argv, prog=prog, description=__doc__)
    torch.set_num_threads(args.threads)
    runner = ModelRunner(ExecutorConfig(model=args.model, dtype="fp32", device="cpu", attention_backend="cpu",
                                        block_size=BLOCK_SIZE, num_blocks=256,
                                        fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=max(args.sizes) + 7)))
    fused = next((path.fused for path in runner.paths if path.name == "fused_decode"), None)
    if fused is None:
        raise SystemExit(f"{args.model}: the fused CPU step does not take this model (see the executor's log line)")
    caches = runner.kv_cache.layers
    print(f"{args.model}, {args.threads} thread(s), {cpu_model_name()}; median of {args.rounds} rounds, ms")
    print(f"{'step':<28} {'fused':>8} {'eager':>8} {'fused/eager':>12}")
    for size in args.sizes:
        for label, contexts, query_lens in (
                (f"prompt {size}", [size], [size]),
                (f"prompt {size} + 7 decodes", [size] + [DECODE_CONTEXT] * 7, [size] + [1] * 7)):
            ids, positions, meta, _ = step(runner, contexts, query_lens)
            with torch.inference_mode():
                fused_ms, eager_ms = [], []
                for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both
                    fused_ms += time_ms(lambda: fused(ids, positions, caches, meta), 1)
                    eager_ms += time_ms(lambda: runner.model(ids, positions, caches, meta), 1)
            f, e = statistics.median(fused_ms), statistics.median(eager_ms)
            print(f"{label:<28} {f:8.3f} {e:8.3f} {f / e:12.2f}")
    return 0
