"""The serving benchmark against Hugging Face baselines.

    tokenmill bench --preset headline          (make bench)
    tokenmill bench --preset quick             (make bench-quick)
    tokenmill bench --preset stories --num-requests 64 --request-rate 8 --slo-ttft-ms 300
    python -m benchmarks.serving --preset quick  (the same, without the CLI)

Runs one workload (same prompts, same forced output lengths, greedy) through up to four
systems: tokenmill's four services over gRPC, the in-process engine, HF generate() one
request at a time, and HF static batching. Writes a JSON result and a PNG under
benchmarks/results/ and ends with a one-line summary of the headline ratios.

This module is the driver (flags, presets, the workload, running the systems, the report);
the systems live beside it: inprocess.py, services_run.py (through services.stack), hf.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from benchmarks.serving import presets
from benchmarks.serving.workload import LengthDist, WorkloadSpec, build_workload
from services.runtime.model.attention.names import BACKEND_NAMES

PROG = "python -m benchmarks.serving"

SYSTEM_ORDER = ("inprocess", "services", "hf-static", "hf-sequential")
"""In-process and services run back to back, so their comparison sees the same machine load."""


def build_parser(preset_names: list[str], prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=preset_names, default="quick", help="starting configuration")
    w = p.add_argument_group("workload (defaults come from the preset)")
    w.add_argument("--model", help="model directory, or random:PRESET (built into benchmarks/.cache)")
    w.add_argument("--num-requests", type=int)
    w.add_argument("--concurrency", type=int, help="requests in flight (closed loop); HF static batch size")
    w.add_argument("--request-rate", type=float, help="Poisson arrivals per second (concurrency then caps in-flight)")
    w.add_argument("--prompt-len", help="prompt tokens: N or LOW:HIGH (uniform)")
    w.add_argument("--output-len", help="output tokens: N or LOW:HIGH (uniform), forced with ignore_eos")
    w.add_argument("--prompts-file", help="JSONL prompts ({'prompt': text} or {'prompt_ids': [...]})")
    w.add_argument("--shared-prefix-fraction", type=float, help="leading share of every prompt that is identical")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("systems")
    s.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEM_ORDER)} (default: the preset's)")
    s.add_argument("--address", help="benchmark a running stack at this address instead of launching one")
    s.add_argument("--scheduler-metrics-url", help="with --address: the scheduler's /metrics URL (KV waste, steps)")
    s.add_argument("--executor-metrics-url", help="with --address: the executor's /metrics URL (compute time)")
    s.add_argument("--hf-sequential-requests", type=int,
                   help="run HF sequential on the first N requests only (0 = all; default: the preset's)")
    s.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                   help="intra-op threads of every system (this process, and OMP_NUM_THREADS for the services); "
                        "default: every core, as torch would use (%(default)s here). On a machine other jobs "
                        "share, 1 is steadier: OpenMP threads that lose their core stall each other")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES,
                   help="both tokenmill systems' attention (auto = cpu, the C++ paged decode kernel, when it builds)")
    s.add_argument("--kv-cache-bytes", type=int, help="KV pool of both tokenmill systems (default: the preset's)")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    o = p.add_argument_group("SLO (goodput counts requests meeting every one given)")
    o.add_argument("--slo-ttft-ms", type=float)
    o.add_argument("--slo-tpot-ms", type=float)
    o.add_argument("--slo-e2e-ms", type=float)
    r = p.add_argument_group("output")
    r.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default: benchmarks/results)")
    r.add_argument("--name", help="file name stem (default: bench-PRESET-TIMESTAMP)")
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    return p


def _pick(value, default):
    return default if value is None else value


def format_table(summaries: dict[str, dict]) -> str:
    header = (f"{'system':22s} {'req/s':>7s} {'out tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} "
              f"{'TPOT p99':>9s} {'e2e p50':>8s} {'goodput':>8s} {'KV peak':>8s} {'KV waste':>8s} {'tok/CPU-s':>9s}")
    lines = [header, "-" * len(header)]
    for name, s in summaries.items():
        kv = s.get("kv_cache") or {}
        waste = kv.get("mean_waste")
        if waste is None:
            waste = s.get("kv_padding_waste_mean")
        peak = kv.get("peak_usage")
        lines.append(
            f"{name:22s} {s['request_throughput_rps']:7.2f} {s['output_throughput_tps']:9.1f} "
            f"{s['ttft_ms']['p50']:7.0f}ms {s['ttft_ms']['p99']:7.0f}ms {s['tpot_ms']['p50']:7.1f}ms "
            f"{s['tpot_ms']['p99']:7.1f}ms {s['e2e_ms']['p50'] / 1000:7.2f}s {s['goodput_rps']:8.2f} "
            f"{'n/a' if peak is None else f'{100 * peak:.2f}%':>8s} "
            f"{'n/a' if waste is None else f'{100 * waste:.1f}%':>8s} "
            f"{s.get('output_tokens_per_cpu_second', float('nan')):9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the benchmark; ``prog`` names the command in messages, the plot and the JSON result."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(sorted(presets.PRESETS), prog).parse_args(argv)
    preset = presets.PRESETS[args.preset]
    systems = tuple(args.systems.split(",")) if args.systems else preset.systems
    unknown = set(systems) - set(SYSTEM_ORDER)
    if unknown:
        print(f"{prog}: unknown systems {sorted(unknown)}; known: {', '.join(SYSTEM_ORDER)}", file=sys.stderr)
        return 2
    try:
        if args.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        model_dir = presets.resolve_model(_pick(args.model, preset.model))
        spec = WorkloadSpec(
            num_requests=_pick(args.num_requests, preset.num_requests),
            prompt_len=LengthDist.parse(_pick(args.prompt_len, preset.prompt_len), "--prompt-len"),
            output_len=LengthDist.parse(_pick(args.output_len, preset.output_len), "--output-len"),
            concurrency=_pick(args.concurrency, preset.concurrency),
            request_rate=_pick(args.request_rate, preset.request_rate),
            shared_prefix_fraction=_pick(args.shared_prefix_fraction, preset.shared_prefix_fraction),
            prompts_file=args.prompts_file, seed=args.seed)
        requests = _workload(model_dir, spec)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    hf_seq_n = _pick(args.hf_sequential_requests, preset.hf_sequential_requests) or None
    if hf_seq_n is not None and hf_seq_n >= len(requests):
        hf_seq_n = None
    args.prog = prog
    args.command = f"{prog} {shlex.join(argv)}"
    result = run_systems(args, preset, model_dir, spec, requests, [s for s in SYSTEM_ORDER if s in systems], hf_seq_n)
    return 0 if result is not None else 1


def _workload(model_dir: str, spec: WorkloadSpec):
    from services.runtime.model.config import ModelConfig

    config = ModelConfig.from_model_dir(model_dir)
    tokenizer = None
    if spec.prompts_file:
        from services.tokenizer.text_tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_dir(model_dir)
    return build_workload(spec, config.vocab_size, config.max_model_len, tokenizer)


def run_systems(args, preset, model_dir: str, spec, requests, systems: list[str], hf_seq_n: int | None):
    from tqdm import tqdm

    from benchmarks.serving.inprocess import EngineOptions
    from benchmarks.serving.records import SLO, summarize
    from benchmarks.serving.report import build_result, write_json, write_plot
    from services.runtime.model.attention.registry import resolve_backend_name

    # A preset's pool is sized for its own model; another model gets the engine's default pool.
    default_kv = preset.kv_cache_bytes if args.model is None else EngineOptions().kv_cache_bytes
    options = EngineOptions(block_size=args.block_size, kv_cache_bytes=_pick(args.kv_cache_bytes, default_kv),
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            attention_backend=args.attention_backend)
    slo = SLO(_pick(args.slo_ttft_ms, preset.slo_ttft_ms), _pick(args.slo_tpot_ms, preset.slo_tpot_ms),
              args.slo_e2e_ms)
    import torch

    torch.set_num_threads(args.torch_threads)
    runs, summaries = {}, {}
    hf_model = None
    print(f"{args.prog} --preset {args.preset}: {len(requests)} requests, model {model_dir}, "
          f"systems {', '.join(systems)}", file=sys.stderr)
    for system in systems:
        subset = requests[:hf_seq_n] if system == "hf-sequential" and hf_seq_n else requests
        bar = tqdm(total=len(subset), desc=f"{system:13s}", unit="req", disable=args.no_progress, file=sys.stderr)
        try:
            if system in ("hf-static", "hf-sequential") and hf_model is None:
                from benchmarks.serving.hf import load_hf_model

                hf_model = load_hf_model(model_dir)
            load_before = os.getloadavg()[0]
            run = _run_one(system, args, model_dir, spec, subset, options, hf_model, bar)
            # Other processes on the machine skew timings; the 1-minute load says how much.
            run.extra["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        finally:
            bar.close()
        if system == "hf-sequential" and hf_seq_n:
            run.notes.append(f"ran on the first {hf_seq_n} of {len(requests)} requests; throughput is over those")
        runs[run.name] = run
        summaries[run.name] = summarize(run, slo)
    meta = {
        "command": args.command,
        "preset": args.preset,
        "preset_description": preset.description,
        "model": model_dir,
        "workload": {"num_requests": spec.num_requests, "concurrency": spec.concurrency,
                     "request_rate": spec.request_rate, "prompt_len": str(spec.prompt_len),
                     "output_len": str(spec.output_len), "shared_prefix_fraction": spec.shared_prefix_fraction,
                     "prompts_file": spec.prompts_file, "seed": spec.seed,
                     "mean_prompt_len": sum(len(r.prompt_ids) for r in requests) / len(requests),
                     "mean_output_len": sum(r.output_len for r in requests) / len(requests)},
        "engine_options": {"block_size": options.block_size, "kv_cache_bytes": options.kv_cache_bytes,
                           "max_num_seqs": options.max_num_seqs,
                           "max_num_batched_tokens": options.max_num_batched_tokens,
                           "attention_backend": options.attention_backend,
                           "attention_backend_resolved": resolve_backend_name(options.attention_backend,
                                                                              torch.device("cpu")),
                           "dtype": "fp32", "device": "cpu"},
        "slo": slo.as_dict(),
        "torch_threads": args.torch_threads,
        "hf_sequential_requests": hf_seq_n,
        "hf_sequential_subset": hf_seq_n is not None,
        "address": args.address,
    }
    result = build_result(runs, summaries, meta)
    out_dir = Path(args.out_dir) if args.out_dir else presets.RESULTS_DIR  # read now: tests redirect it
    stem = args.name or f"bench-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path = out_dir / f"{stem}.json"
    write_json(result, json_path)
    print(format_table(summaries))
    print(f"wrote {json_path}")
    if not args.no_plot:
        png_path = out_dir / f"{stem}.png"
        write_plot(runs, png_path, f"{args.prog} --preset {args.preset} ({Path(model_dir).name})")
        print(f"wrote {png_path}")
    print(result["summary"])
    return result


def _run_one(system: str, args, model_dir: str, spec, requests, options, hf_model, bar):
    if system == "inprocess":
        from benchmarks.serving.inprocess import run_inprocess

        return run_inprocess(model_dir, requests, spec.concurrency, options, bar)
    if system == "services":
        from benchmarks.serving.services_run import Stack, launched_stack, run_services

        if args.address:
            stack = Stack(args.address, args.scheduler_metrics_url, args.executor_metrics_url)
            return run_services(stack, requests, spec.concurrency, bar)
        with launched_stack(model_dir, options.executor_flags(), options.scheduler_flags(),
                            args.torch_threads) as stack:
            return run_services(stack, requests, spec.concurrency, bar)
    from benchmarks.serving.hf import run_hf_sequential, run_hf_static

    if system == "hf-static":
        return run_hf_static(hf_model, requests, spec.concurrency, bar)
    return run_hf_sequential(hf_model, requests, bar)
