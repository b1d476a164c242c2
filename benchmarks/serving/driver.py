"""The serving benchmark against Hugging Face baselines.

    python -m benchmarks serving --preset headline      (make bench)
    python -m benchmarks serving --preset quick         (make bench-quick)
    python -m benchmarks serving --preset stories --num-requests 64 --request-rate 8 --slo-ttft-ms 300

Runs one workload (same prompts, same forced output lengths, greedy) through up to four
systems: tokenmill's four services over gRPC, the in-process engine, HF generate() one
request at a time, and HF static batching. Writes a JSON result and a PNG under
benchmarks/results/ and ends with a one-line summary of the headline ratios.

This module is the entry (settings, presets, the workload, running the systems); the systems
live beside it (inprocess.py, services_run.py, hf.py) and the report in report.py.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import flags, report as harness_report
from benchmarks.harness.engine import EngineSettings
from benchmarks.harness.flags import config_field, setting
from benchmarks.harness.models import resolve_model
from benchmarks.harness.records import SLO
from benchmarks.serving import presets
from benchmarks.serving.workload import LengthDist, WorkloadSpec, build_workload
from services.common.settings import embedded
from services.executor.config import ExecutorConfig

PROG = "python -m benchmarks serving"

SYSTEM_ORDER = ("inprocess", "services", "hf-static", "hf-sequential")
"""In-process and services run back to back, so their comparison sees the same machine load."""


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """Workload fields left at none take the preset's value."""

    preset: str = setting("quick", choices=tuple(sorted(presets.PRESETS)))
    """Starting configuration."""
    model: str | None = setting(None)
    """Model directory, or random:PRESET (built into benchmarks/.cache)."""
    num_requests: int | None = setting(None)
    """Requests in the workload."""
    concurrency: int | None = setting(None)
    """Requests in flight (closed loop); HF static batch size."""
    request_rate: float | None = setting(None)
    """Poisson arrivals per second (concurrency then caps in-flight)."""
    prompt_len: str | None = setting(None)
    """Prompt tokens: N or LOW:HIGH (uniform)."""
    output_len: str | None = setting(None)
    """Output tokens: N or LOW:HIGH (uniform), forced with ignore_eos."""
    prompts_file: str | None = setting(None)
    """JSONL prompts ({'prompt': text} or {'prompt_ids': [...]})."""
    shared_prefix_fraction: float | None = setting(None)
    """Leading share of every prompt that is identical."""
    seed: int = setting(0)
    """Seed of the workload."""
    systems: tuple[str, ...] = setting((), choices=SYSTEM_ORDER)
    """Which systems to run, comma-separated (empty: the preset's)."""
    address: str | None = setting(None)
    """Benchmark a running stack at this address instead of launching one."""
    scheduler_metrics_url: str | None = setting(None)
    """With --address: the scheduler's /metrics URL (KV waste, steps)."""
    executor_metrics_url: str | None = setting(None)
    """With --address: the executor's /metrics URL (compute time)."""
    hf_sequential_requests: int | None = setting(None)
    """Run HF sequential on the first N requests only (0 = all; none: the preset's)."""
    torch_threads: int = setting(os.cpu_count() or 1)
    """intra-op threads of every system (this process, and OMP_NUM_THREADS for the services); default: every core, as
    torch would use. On a machine other jobs share, 1 is steadier: OpenMP threads that lose their core stall each
    other."""
    kv_cache_bytes: int | None = config_field(ExecutorConfig, "kv_cache_bytes", default=None,
                                              note="Both tokenmill systems' pool (none: the preset's).")
    engine: EngineSettings = embedded(EngineSettings, env_prefix="")
    slo_ttft_ms: float | None = setting(None)
    """SLO on time to first token (goodput counts requests meeting every SLO)."""
    slo_tpot_ms: float | None = setting(None)
    """SLO on time per output token."""
    slo_e2e_ms: float | None = setting(None)
    """SLO on end-to-end latency."""
    out_dir: str | None = setting(None)
    """Where the JSON and PNG go (none: benchmarks/results)."""
    name: str | None = setting(None)
    """File name stem (none: bench-PRESET-TIMESTAMP)."""
    plot: bool = setting(True)
    """Write the PNG."""
    progress: bool = setting(True)
    """Progress bars on stderr."""

    def validate(self) -> None:
        flags.check_choices("preset", self.preset, sorted(presets.PRESETS))
        if self.systems:
            flags.check_choices("systems", self.systems, SYSTEM_ORDER)
        flags.check_at_least(self, 1, "torch_threads")
        self.engine.validate()

    @property
    def preset_config(self) -> presets.Preset:
        return presets.PRESETS[self.preset]

    def workload(self) -> WorkloadSpec:
        preset = self.preset_config
        return WorkloadSpec(
            num_requests=_pick(self.num_requests, preset.num_requests),
            prompt_len=LengthDist.parse(_pick(self.prompt_len, preset.prompt_len), "--prompt-len"),
            output_len=LengthDist.parse(_pick(self.output_len, preset.output_len), "--output-len"),
            concurrency=_pick(self.concurrency, preset.concurrency),
            request_rate=_pick(self.request_rate, preset.request_rate),
            shared_prefix_fraction=_pick(self.shared_prefix_fraction, preset.shared_prefix_fraction),
            prompts_file=self.prompts_file, seed=self.seed)

    def slo(self) -> SLO:
        preset = self.preset_config
        return SLO(_pick(self.slo_ttft_ms, preset.slo_ttft_ms), _pick(self.slo_tpot_ms, preset.slo_tpot_ms),
                   self.slo_e2e_ms)

    def pool_bytes(self) -> int:
        """A preset's pool is sized for its own model; another model gets the engine's default pool."""
        default = self.preset_config.kv_cache_bytes if self.model is None else ExecutorConfig(model="").kv_cache_bytes
        return _pick(self.kv_cache_bytes, default)


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
    settings = flags.parse(ServingSettings, argv, prog=prog, description=__doc__)
    try:
        model_dir = resolve_model(_pick(settings.model, settings.preset_config.model))
        spec = settings.workload()
        requests = _workload(model_dir, spec)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    preset = settings.preset_config
    hf_seq_n = _pick(settings.hf_sequential_requests, preset.hf_sequential_requests) or None
    if hf_seq_n is not None and hf_seq_n >= len(requests):
        hf_seq_n = None
    systems = settings.systems or preset.systems
    command = harness_report.command_line(prog, argv)
    result = run_systems(settings, command, prog, model_dir, spec, requests,
                         [s for s in SYSTEM_ORDER if s in systems], hf_seq_n)
    return 0 if result is not None else 1


def _workload(model_dir: str, spec: WorkloadSpec):
    from services.runtime.model.config import ModelConfig

    config = ModelConfig.from_model_dir(model_dir)
    tokenizer = None
    if spec.prompts_file:
        from services.tokenizer.text_tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_dir(model_dir)
    return build_workload(spec, config.vocab_size, config.max_model_len, tokenizer)


def run_systems(settings: ServingSettings, command: str, prog: str, model_dir: str, spec: WorkloadSpec, requests,
                systems: list[str], hf_seq_n: int | None):
    import torch
    from tqdm import tqdm

    from benchmarks.harness.records import summarize
    from benchmarks.serving.report import build_result, write_plot

    engine, slo = settings.engine, settings.slo()
    executor = engine.executor_config(model_dir, settings.pool_bytes())
    torch.set_num_threads(settings.torch_threads)
    runs, summaries = {}, {}
    hf_model = None
    print(f"{prog} --preset {settings.preset}: {len(requests)} requests, model {model_dir}, "
          f"systems {', '.join(systems)}", file=sys.stderr)
    load = harness_report.LoadWatch()
    for system in systems:
        subset = requests[:hf_seq_n] if system == "hf-sequential" and hf_seq_n else requests
        bar = tqdm(total=len(subset), desc=f"{system:13s}", unit="req", disable=not settings.progress, file=sys.stderr)
        try:
            if system in ("hf-static", "hf-sequential") and hf_model is None:
                from benchmarks.harness.hf import load_model

                hf_model = load_model(model_dir)
            load_before = os.getloadavg()[0]
            run = _run_one(system, settings, executor, spec, subset, hf_model, bar)
            # Other processes on the machine skew timings; the 1-minute load says how much.
            run.extra["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        finally:
            bar.close()
        if system == "hf-sequential" and hf_seq_n:
            run.notes.append(f"ran on the first {hf_seq_n} of {len(requests)} requests; throughput is over those")
        runs[run.name] = run
        summaries[run.name] = summarize(run, slo)
    load.stop()
    meta = _run_meta(settings, executor, model_dir, spec, requests, hf_seq_n)
    result = build_result(runs, summaries, harness_report.provenance(command, load) | meta)
    out_dir = Path(settings.out_dir) if settings.out_dir else None
    stem = settings.name or f"bench-{settings.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path = harness_report.write_result(result, harness_report.result_path("bench", out_dir=out_dir, name=stem))
    print(format_table(summaries))
    print(f"wrote {json_path}")
    if settings.plot:
        png_path = json_path.with_suffix(".png")
        write_plot(runs, png_path, f"{prog} --preset {settings.preset} ({Path(model_dir).name})")
        print(f"wrote {png_path}")
    print(result["summary"])
    return result


def _run_meta(settings: ServingSettings, executor: ExecutorConfig, model_dir: str, spec: WorkloadSpec, requests,
              hf_seq_n: int | None) -> dict:
    """The result's record of what ran: preset, workload, engine options, SLO."""
    import torch

    from services.runtime.model.attention.registry import resolve_backend_name

    engine = settings.engine
    return {
        "preset": settings.preset,
        "preset_description": settings.preset_config.description,
        "model": model_dir,
        "workload": {"num_requests": spec.num_requests, "concurrency": spec.concurrency,
                     "request_rate": spec.request_rate, "prompt_len": str(spec.prompt_len),
                     "output_len": str(spec.output_len), "shared_prefix_fraction": spec.shared_prefix_fraction,
                     "prompts_file": spec.prompts_file, "seed": spec.seed,
                     "mean_prompt_len": sum(len(r.prompt_ids) for r in requests) / len(requests),
                     "mean_output_len": sum(r.output_len for r in requests) / len(requests)},
        "engine_options": {"block_size": executor.block_size, "kv_cache_bytes": executor.kv_cache_bytes,
                           "max_num_seqs": engine.limits.max_num_seqs,
                           "max_num_batched_tokens": engine.limits.max_num_batched_tokens,
                           "attention_backend": executor.attention_backend,
                           "attention_backend_resolved": resolve_backend_name(executor.attention_backend,
                                                                              torch.device("cpu")),
                           "dtype": executor.dtype, "device": executor.device, "compile": executor.compiled_decode.compile,
                           "scheduler_flags": engine.scheduler_flags()},
        "slo": settings.slo().as_dict(),
        "torch_threads": settings.torch_threads,
        "hf_sequential_requests": hf_seq_n,
        "hf_sequential_subset": hf_seq_n is not None,
        "address": settings.address,
    }


def _run_one(system: str, settings: ServingSettings, executor: ExecutorConfig, spec: WorkloadSpec, requests,
             hf_model, bar):
    if system == "inprocess":
        from benchmarks.serving.inprocess import run_inprocess

        return run_inprocess(settings.engine.engine(executor), requests, spec.concurrency, bar)
    if system == "services":
        from benchmarks.harness.launch import LaunchSpec, Stack, launched
        from benchmarks.serving.services_run import run_services

        if settings.address:
            stack = Stack(settings.address, settings.scheduler_metrics_url, settings.executor_metrics_url)
            return run_services(stack, requests, spec.concurrency, bar)
        launch = LaunchSpec(executor.model, tuple(settings.engine.executor_flags(executor)),
                            tuple(settings.engine.scheduler_flags()), threads=settings.torch_threads)
        with launched(launch) as stack:
            return run_services(stack, requests, spec.concurrency, bar)
    from benchmarks.serving.hf import run_hf_sequential, run_hf_static

    if system == "hf-static":
        return run_hf_static(hf_model, requests, spec.concurrency, bar)
    return run_hf_sequential(hf_model, requests, bar)
