"""Decode throughput of the in-process engine against Hugging Face ``generate()`` on the same weights.

    python -m benchmarks decode [--preset llama-100m] [--batch-sizes 1,8,32]
        [--prompt-len 64] [--output-len 128] [--repeats 3] [--threads N] [--json PATH]   (make bench-decode)

The model is a deterministic random-weight checkpoint (``PRESETS[preset]``), written once
under ``benchmarks/.cache/`` with a synthetic tokenizer (harness.models), so both systems
load one directory.
Every request is greedy with ``ignore_eos`` and a fixed prompt of token ids (distinct per
request and per run; prefix caching off), so every run does the same work.

What is measured, per run (medians over ``repeats`` runs, after one warm-up run):

- TTFT: from submitting the batch until every request has its first token. The step token
  budget holds the whole batch's prompts, so this is one prefill step.
- decode tok/s: tokens generated after the first ones, over the time after TTFT:
  ``B * (output_len - 1) / (total - TTFT)``. This is the steady decode rate.
- total tok/s: ``B * output_len / total``, prefill included.

Hugging Face runs at batch 1 (``generate(do_sample=False)``, its default dynamic cache); its
first token is timed by a streamer. Ratios are engine decode tok/s over HF's at batch 1.
"""

from __future__ import annotations

import os
import statistics
import time
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.harness import flags, report
from benchmarks.harness.engine import run_batch
from benchmarks.harness.flags import setting
from benchmarks.harness.hf import load_model
from benchmarks.harness.models import random_model_dir
from services.tools.random_model import PRESETS
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits

PROG = "python -m benchmarks decode"
FIRST_REGULAR_TOKEN_ID = 3  # after <unk> <s> </s>: prompts hold no special tokens


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    preset: str = setting("llama-100m", choices=tuple(sorted(PRESETS)))
    """Random-weight model."""
    device: str = setting("cpu")
    """cpu, cuda or cuda:N (both systems)."""
    batch_sizes: tuple[int, ...] = setting((1, 8, 32))
    """The engine's batch sizes, comma-separated."""
    prompt_len: int = setting(64)
    """Prompt tokens of every request."""
    output_len: int = setting(128)
    """Output tokens of every request (EOS ignored)."""
    repeats: int = setting(3)
    """Timed runs of every configuration (medians reported)."""
    threads: int = setting(0)
    """torch threads (0 = torch's default for this machine)."""
    json: Path | None = setting(None)
    """Also write the results here."""

    def validate(self) -> None:
        flags.check_choices("preset", self.preset, sorted(PRESETS))
        flags.check_at_least(self, 1, "prompt_len", "repeats")
        flags.check_at_least(self, 2, "output_len")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive, got {self.batch_sizes}")


@dataclass(frozen=True, slots=True)
class RunTiming:
    batch_size: int
    output_len: int
    ttft_s: float
    total_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * (self.output_len - 1) / (self.total_s - self.ttft_s)

    @property
    def total_tokens_per_s(self) -> float:
        return self.batch_size * self.output_len / self.total_s


@dataclass(frozen=True, slots=True)
class Summary:
    system: str
    batch_size: int
    ttft_ms: float
    decode_tokens_per_s: float
    total_tokens_per_s: float
    runs: int


def summarize(system: str, timings: list[RunTiming]) -> Summary:
    return Summary(
        system=system,
        batch_size=timings[0].batch_size,
        ttft_ms=statistics.median(t.ttft_s for t in timings) * 1e3,
        decode_tokens_per_s=statistics.median(t.decode_tokens_per_s for t in timings),
        total_tokens_per_s=statistics.median(t.total_tokens_per_s for t in timings),
        runs=len(timings),
    )


class PromptSource:
    """Distinct random token-id prompts, so no run can reuse another's K/V."""

    def __init__(self, vocab_size: int, prompt_len: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.prompt_len = prompt_len
        self.generator = torch.Generator().manual_seed(seed)

    def take(self, n: int) -> list[list[int]]:
        ids = torch.randint(FIRST_REGULAR_TOKEN_ID, self.vocab_size, (n, self.prompt_len), generator=self.generator)
        return ids.tolist()


# ---------------------------------------------------------------------------- the engine


def make_engine(model_dir: Path, device: str, max_batch: int, prompt_len: int, output_len: int) -> Engine:
    block_size = 16
    blocks_per_seq = -(-(prompt_len + output_len) // block_size)
    # Context capped at what a request needs, so the pool is exactly the batch's blocks.
    executor = ExecutorConfig(model=str(model_dir), dtype="float32", device=device, block_size=block_size,
                              num_blocks=max_batch * blocks_per_seq, max_model_len=prompt_len + output_len)
    limits = SchedulerLimits(max_num_seqs=max_batch, max_num_batched_tokens=max_batch * prompt_len,
                             enable_prefix_caching=False)
    return Engine(EngineConfig(executor, limits))


def engine_run(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[RunTiming, list[list[int]]]:
    batch = run_batch(engine, prompts, output_len)
    assert all(len(t) == output_len for t in batch.outputs), "every request must run to output_len"
    return RunTiming(len(prompts), output_len, batch.first_tokens_s, batch.seconds), batch.outputs


# ---------------------------------------------------------------------------- Hugging Face


def hf_run(model, prompt: list[int], output_len: int) -> tuple[RunTiming, list[int]]:
    from transformers.generation.streamers import BaseStreamer

    class FirstTokenClock(BaseStreamer):
        """generate() calls put() with the prompt, then once per new token."""

        def __init__(self):
            self.calls = 0
            self.first_token_at: float | None = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:
                self.first_token_at = time.perf_counter()

        def end(self):
            pass

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)  # [1, P]
    clock = FirstTokenClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, streamer=clock)  # [1, P + O]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    return RunTiming(1, output_len, clock.first_token_at - start, end - start), out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------- report


def machine_description(device: str) -> str:
    text = f"{report.cpu_model_name()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if device.startswith("cuda"):
        text += f", {torch.cuda.get_device_name()}"
    return text


def print_table(rows: list[Summary], hf_decode: float) -> None:
    print(f"{'system':<10} {'batch':>5} {'TTFT ms':>9} {'decode tok/s':>13} {'total tok/s':>12} {'x HF b1':>8}")
    for r in rows:
        print(f"{r.system:<10} {r.batch_size:>5} {r.ttft_ms:>9.1f} {r.decode_tokens_per_s:>13.1f} "
              f"{r.total_tokens_per_s:>12.1f} {r.decode_tokens_per_s / hf_decode:>8.2f}")


def run_benchmark(args) -> dict:
    model_dir = random_model_dir(args.preset)
    spec = PRESETS[args.preset]
    prompts = PromptSource(spec.vocab_size, args.prompt_len)
    print(f"model {args.preset} ({spec.num_parameters() / 1e6:.1f}M params, fp32) on {args.device}; "
          f"{machine_description(args.device)}")
    print(f"prompt {args.prompt_len} tokens, output {args.output_len} tokens, greedy, ignore_eos; "
          f"median of {args.repeats} runs after a warm-up", flush=True)

    engine = make_engine(model_dir, args.device, max(args.batch_sizes), args.prompt_len, args.output_len)
    hf = load_model(str(model_dir), args.device)

    # Warm-up (allocator, lazy initialisation), and a check that both systems compute the same thing.
    (check_prompt,) = prompts.take(1)
    _, (ours,) = engine_run(engine, [check_prompt], args.output_len)
    _, theirs = hf_run(hf, check_prompt, args.output_len)
    same = ours == theirs
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    print(f"batch-1 greedy outputs identical to HF: {same} (first {agree} tokens agree)", flush=True)

    # Repeats are interleaved (each runs every configuration once), so load from other
    # processes on a shared machine lands on all configurations alike.
    load_before = report.load_average()
    hf_timings: list[RunTiming] = []
    engine_timings: dict[int, list[RunTiming]] = {b: [] for b in args.batch_sizes}
    for repeat in range(args.repeats):
        hf_timings.append(hf_run(hf, prompts.take(1)[0], args.output_len)[0])
        for batch_size in args.batch_sizes:
            engine_timings[batch_size].append(engine_run(engine, prompts.take(batch_size), args.output_len)[0])
        print(f"  run {repeat + 1}/{args.repeats}: HF b1 {hf_timings[-1].decode_tokens_per_s:.1f} tok/s, engine "
              + ", ".join(f"b{b} {t[-1].decode_tokens_per_s:.1f}" for b, t in engine_timings.items()), flush=True)
    load_after = report.load_average()
    rows = [summarize("hf", hf_timings)] + [summarize("tokenmill", t) for t in engine_timings.values()]
    hf_decode = rows[0].decode_tokens_per_s
    print(f"\n1-minute load average: {load_before:.2f} before, {load_after:.2f} after")
    print_table(rows, hf_decode)
    return {
        "preset": args.preset,
        "machine": machine_description(args.device),
        "load_average": [load_before, load_after],
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "outputs_identical_to_hf": same,
        "rows": [asdict(r) | {"decode_x_hf_batch1": r.decode_tokens_per_s / hf_decode} for r in rows],
    }


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = flags.parse(DecodeSettings, argv, prog=prog, description=__doc__)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = report.provenance(report.command_line(prog, argv)) | run_benchmark(args)
    path = report.write_result(result, report.result_path("decode", args.json))
    print(f"result: {path}")
    return 0
