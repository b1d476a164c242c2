"""Micro-benchmark of the sampler: batch build and sampling time, greedy vs mixed parameters.

    python -m benchmarks sampler [--device cuda] [--repeats 20]

Prints the median over ``repeats`` runs of SamplingBatch.build and of Sampler.__call__ for
B = 32 and 256 rows at V = 32000. "mixed" is a realistic spread: a quarter greedy, the rest
with temperature, top-k / top-p / min-p, penalties over 512 prompt + 128 output tokens,
some seeded rows and some asking for logprobs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from services.runtime.sampling.batch import SamplingBatch
from services.common.sampling_params import SamplingParams
from services.runtime.sampling.sampler import Sampler

PROG = "python -m benchmarks sampler"
VOCAB_SIZE = 32000
PROMPT_LEN = 512
OUTPUT_LEN = 128


def greedy_params(batch_size: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0) for _ in range(batch_size)]


def mixed_params(batch_size: int) -> list[SamplingParams]:
    variants = [
        lambda i: SamplingParams(temperature=0.0),
        lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        lambda i: SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.1, seed=i),
        lambda i: SamplingParams(
            temperature=1.0, top_p=0.9, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={5: -10.0}, logprobs=5
        ),
    ]
    return [variants[i % len(variants)](i) for i in range(batch_size)]


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, generator creation, lazy kernels
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_benchmark(device: torch.device, repeats: int = 20, batch_sizes: tuple[int, ...] = (32, 256)) -> None:
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0)
    print(f"device={device} V={VOCAB_SIZE} prompt={PROMPT_LEN} output={OUTPUT_LEN} (median of {repeats})")
    print(f"{'B':>5} {'params':>8} {'build ms':>10} {'sample ms':>10}")
    for batch_size in batch_sizes:
        prompts = torch.randint(0, VOCAB_SIZE, (batch_size, PROMPT_LEN), generator=generator).tolist()
        outputs = torch.randint(0, VOCAB_SIZE, (batch_size, OUTPUT_LEN), generator=generator).tolist()
        logits = torch.randn(batch_size, VOCAB_SIZE, generator=generator).to(device)  # [B, V]
        for name, make in (("greedy", greedy_params), ("mixed", mixed_params)):
            params = make(batch_size)

            def build() -> SamplingBatch:
                return SamplingBatch.build(params, prompts, outputs, VOCAB_SIZE, device)

            batch = build()
            build_s = _median_seconds(build, device, repeats)
            sample_s = _median_seconds(lambda: sampler(logits, batch), device, repeats)
            print(f"{batch_size:>5} {name:>8} {build_s * 1e3:>10.3f} {sample_s * 1e3:>10.3f}")


@dataclass(frozen=True, slots=True)
class SamplerSettings:
    device: str = setting("cpu")
    """cpu, cuda or cuda:N."""
    repeats: int = setting(20)
    """Timed runs of each case (the median is printed)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "repeats")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(SamplerSettings, argv, prog=prog, description=__doc__)
    run_benchmark(torch.device(args.device), args.repeats)
    return 0
