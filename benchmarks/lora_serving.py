"""Multi-LoRA serving on the CPU, in process (services.inprocess.Engine), ratios in one run:

    python -m benchmarks lora-serving                       (make bench-lora runs it)
    python -m benchmarks lora-serving --model models/smollm2-135m-instruct-q4_1 --streams 32 --adapters 8

1. ``--streams`` greedy streams of the base model alone against the same streams spread
   round-robin over ``--adapters`` adapters (one step mixes them all): tokens/s ratio (target
   >= 0.8).
2. One stream of one adapter against one stream of the base (target >= 0.9).
3. ``--streams`` adapter streams while another thread loads one more adapter from its
   directory: each stream's largest inter-token gap against its median gap (target: none above
   2x); the same streams without a load beside it, for reference.

The adapters are random rank-``--rank`` PEFT adapters of all seven target modules, written as
PEFT saves them (adapter_config.json, adapter_model.safetensors) into a temporary directory.
Every run reuses one engine, so the ratios share the machine's state; the runs alternate within
each pass and each figure is the median over ``--repeats`` passes, so the machine's other load
shows in the absolute numbers more than in what the ratios compare. The load average is printed
before and after.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import flags
from benchmarks.harness.flags import setting

PROG = "python -m benchmarks lora-serving"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoraServingSettings:
    model: str = setting("models/smollm2-135m-instruct-q4_1")
    """The base model's directory."""
    streams: int = setting(32)
    """Concurrent streams of the throughput and load runs."""
    adapters: int = setting(8)
    """Adapters the mixed streams are spread over."""
    rank: int = setting(16)
    """Rank of every adapter."""
    prompt_tokens: int = setting(32)
    """Prompt length (random token ids)."""
    max_tokens: int = setting(32)
    """Tokens generated per stream."""
    single_tokens: int = setting(64)
    """Tokens of the single-stream runs."""
    repeats: int = setting(3)
    """Alternating passes of the throughput runs (their medians are reported)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "streams", "adapters", "rank", "prompt_tokens", "max_tokens",
                             "single_tokens", "repeats")


def write_adapter(directory: Path, model_config, rank: int, seed: int) -> Path:
    """A random PEFT adapter of every target module (small enough to keep the model fluent)."""
    import torch
    from safetensors.torch import save_file

    from services.runtime.lora.adapter import module_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (out_features, in_features) in module_shapes(model_config).items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return directory


def run_streams(engine, prompts: list[list[int]], adapters: list[str], max_tokens: int,
                beside=None) -> tuple[float, dict[int, list[float]]]:
    """Generated tokens/s over the run, and each stream's token arrival times. ``beside``: a
    callable started on another thread once every stream has its first token."""
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request.stop import StopConditions

    ids = {engine.add_request(prompt, SamplingParams(temperature=0.0),
                              StopConditions(max_tokens=max_tokens, ignore_eos=True), adapter=adapter): i
           for i, (prompt, adapter) in enumerate(zip(prompts, adapters))}
    arrivals: dict[int, list[float]] = {i: [] for i in ids.values()}
    thread = None
    tokens = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error_message is None, delta.error_message
            now = time.perf_counter()
            arrivals[ids[delta.request_id]].extend([now] * len(delta.token_ids))
            tokens += len(delta.token_ids)
        if beside is not None and thread is None and all(arrivals.values()):
            thread = threading.Thread(target=beside)
            thread.start()
    elapsed = time.perf_counter() - started
    if thread is not None:
        thread.join()
    return tokens / elapsed, arrivals


def gap_ratio(arrivals: dict[int, list[float]]) -> float:
    """The largest over streams of (largest inter-token gap / median gap), decode gaps only."""
    worst = 0.0
    for times in arrivals.values():
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]  # tokens of one step arrive together
        if len(gaps) >= 2:
            worst = max(worst, max(gaps) / statistics.median(gaps))
    return worst


def print_conditions(rates: dict[str, list[float]], load_before, load_after) -> None:
    """The load average around the runs, and each pass's ratios (the medians hide their spread)."""
    print(f"load average (1, 5, 15 min) before {' '.join(f'{v:.2f}' for v in load_before)}, "
          f"after {' '.join(f'{v:.2f}' for v in load_after)}")
    print("per pass, mixed / base: " + " ".join(f"{m / b:.2f}" for m, b in zip(rates["mixed"], rates["base"]))
          + "; 1 adapter / base 1 stream: "
          + " ".join(f"{a / b:.2f}" for a, b in zip(rates["single_adapter"], rates["single_base"])))


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(LoraServingSettings, argv, prog=prog, description=__doc__)
    from services.executor.config import ExecutorConfig
    from services.inprocess.engine import Engine, EngineConfig
    from services.runtime.model.config import ModelConfig
    from services.scheduler.core.config import SchedulerLimits

    model_config = ModelConfig.from_model_dir(args.model)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="lora-serving-") as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", model_config, args.rank, i) for i in range(args.adapters + 1)]
        names = [f"a{i}" for i in range(args.adapters)]
        config = ExecutorConfig(model=args.model, device="cpu", max_loras=args.adapters + 1, max_lora_rank=args.rank,
                                lora=tuple(f"{n}={p}" for n, p in zip(names, paths)))
        limits = SchedulerLimits(max_num_seqs=max(args.streams, 1), enable_prefix_caching=False)
        engine = Engine(EngineConfig(config, limits=limits))

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(100, model_config.vocab_size - 100) for _ in range(args.prompt_tokens)]
                    for _ in range(n)]

        run_streams(engine, prompts(2), ["", names[0]], 4)  # warm-up: kernels built, slots written

        # The runs alternate within each pass, so a drift of the machine's load favours none.
        runs = {"base": ([""] * args.streams, args.max_tokens),
                "mixed": ([names[i % args.adapters] for i in range(args.streams)], args.max_tokens),
                "single_base": ([""], args.single_tokens), "single_adapter": ([names[0]], args.single_tokens)}
        load_before = os.getloadavg()
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (adapters, max_tokens) in runs.items():
                rates[name].append(run_streams(engine, prompts(len(adapters)), adapters, max_tokens)[0])
        base, mixed, single_base, single_adapter = (statistics.median(rates[name]) for name in runs)
        adapter_streams = [names[i % args.adapters] for i in range(args.streams)]
        _, quiet = run_streams(engine, prompts(args.streams), adapter_streams, args.max_tokens)
        load_seconds = []

        def load() -> None:
            started = time.perf_counter()
            engine.load_adapter(f"a{args.adapters}", str(paths[-1]))
            load_seconds.append(time.perf_counter() - started)

        _, loading = run_streams(engine, prompts(args.streams), adapter_streams, args.max_tokens, beside=load)
        engine.close()
    load_after = os.getloadavg()
    print(f"model {args.model}, {args.streams} streams x {args.max_tokens} tokens, prompt {args.prompt_tokens} "
          f"tokens, {args.adapters} adapters of rank {args.rank} (all 7 modules), medians of {args.repeats} passes")
    print_conditions(rates, load_before, load_after)
    print(f"base {args.streams} streams:        {base:8.1f} tok/s")
    print(f"{args.adapters} adapters mixed, {args.streams} streams: {mixed:8.1f} tok/s   ratio {mixed / base:.2f}"
          f" (target >= 0.8)")
    print(f"base 1 stream:          {single_base:8.1f} tok/s")
    print(f"1 adapter 1 stream:     {single_adapter:8.1f} tok/s   ratio {single_adapter / single_base:.2f}"
          f" (target >= 0.9)")
    print(f"largest gap / median gap over {args.streams} adapter streams: {gap_ratio(quiet):.2f} without a load, "
          f"{gap_ratio(loading):.2f} while an adapter loaded ({load_seconds[0] * 1e3:.0f} ms) (target <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
