"""Where a services step's wall time goes: CPU per step of each process, against the in-process engine.

``python -m benchmarks step-overhead [--streams 1] [--output-len 256] [--rounds 3]``

Starts the four services (one torch thread each, the engine's default settings, a 32 MiB KV
pool) and an in-process engine in this process with the same settings, then alternates timed runs of the two (so machine load
hits both alike) and prints, per round, tokens/s of each, their ratio, and the CPU time each
service process (utime + stime from /proc/<pid>/stat) and this client spent per decode step.
On a 2-core machine the processes share the cores, so CPU per step adds up against the wall.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass

from benchmarks.harness import flags
from benchmarks.harness.client import greedy_request, same_request
from benchmarks.harness.cpu import process_cpu_seconds, thread_cpu_seconds
from benchmarks.harness.engine import EngineSettings, run_batch, warmed_engine
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, launched
from benchmarks.harness.paths import STORIES
from benchmarks.harness.report import load_average
from benchmarks.harness.scrape import scrape

PROG = "python -m benchmarks step-overhead"
PROMPT = [1, 403, 407, 261, 378]
"""BOS + "Once upon a time" in stories260K's tokenizer (any short prompt does)."""
KV_CACHE_BYTES = 32 * 1024**2


@dataclass(frozen=True, slots=True)
class StepOverheadSettings:
    streams: int = setting(1)
    """Streams of one run (batched together)."""
    output_len: int = setting(256)
    """Tokens per stream."""
    rounds: int = setting(3)
    """Alternated runs of each system."""
    model: str = setting(str(STORIES))
    """Model directory."""
    json: str | None = setting(None)
    """Write the figures here."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "streams", "output_len", "rounds")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    seconds = process_cpu_seconds(pid)
    if seconds is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return seconds


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(StepOverheadSettings, argv, prog=prog, description=__doc__)
    import torch
    torch.set_num_threads(1)
    engine_settings = EngineSettings()
    executor = engine_settings.executor_config(args.model, KV_CACHE_BYTES)
    engine = warmed_engine(engine_settings, executor)
    rows = []
    launch = LaunchSpec(args.model, tuple(engine_settings.executor_flags(executor)),
                        tuple(engine_settings.scheduler_flags()), threads=1)
    with launched(launch) as stack:
        same_request(stack.address, greedy_request(PROMPT, 8), args.streams)  # warm
        pids = dict(stack.pids, client=os.getpid())
        for round_ in range(args.rounds):
            own = cpu_seconds(os.getpid())
            run_in = run_batch(engine, [PROMPT] * args.streams, args.output_len)
            out_in = run_in.outputs
            inproc_cpu = cpu_seconds(os.getpid()) - own
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            counters = scrape(stack.scheduler_metrics)
            threads_before = {name: thread_cpu_seconds(pids[name]) for name in ("executor", "scheduler")}
            services_s, records = same_request(stack.address, greedy_request(PROMPT, args.output_len), args.streams)
            out_sv = [r.output_ids for r in records]
            cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            moved = {k: v - counters.get(k, 0.0) for k, v in scrape(stack.scheduler_metrics).items()
                     if k.endswith(("scheduler_steps_total", "scheduler_detokenize_rounds_total"))}
            threads = {}
            for name, was in threads_before.items():
                now = thread_cpu_seconds(pids[name])
                threads[name] = {t: round(1e3 * (v - was.get(t, 0.0)) / args.output_len, 3) for t, v in now.items()
                                 if v - was.get(t, 0.0) > 0}
            steps = args.output_len  # one decode step per token per stream (batched streams share it)
            row = {"inprocess_tok_s": run_in.output_tokens / run_in.seconds,
                   "services_tok_s": sum(map(len, out_sv)) / services_s,
                   "services_ms_per_step": 1e3 * services_s / steps,
                   "inprocess_ms_per_step": 1e3 * run_in.seconds / steps,
                   "cpu_ms_per_step": {k: round(1e3 * v / steps, 3) for k, v in cpu.items()},
                   "inprocess_cpu_ms_per_step": round(1e3 * inproc_cpu / steps, 3),
                   "thread_cpu_ms_per_step": threads,
                   "scheduler_counters": moved,
                   "identical": out_in == out_sv}
            row["ratio"] = row["services_tok_s"] / row["inprocess_tok_s"]
            rows.append(row)
            print(f"round {round_}: in-process {row['inprocess_tok_s']:.0f} tok/s, services {row['services_tok_s']:.0f} "
                  f"tok/s, ratio {row['ratio']:.2f}; in-process CPU {row['inprocess_cpu_ms_per_step']:.2f} ms/step; services {row['services_ms_per_step']:.2f} ms/step, CPU ms/step "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu_ms_per_step"].items())
                  + f"; outputs identical {row['identical']}; scheduler counters {moved}; per thread {threads}", flush=True)
    print(f"median ratio services/in-process: {statistics.median(r['ratio'] for r in rows):.2f} "
          f"({args.streams} stream(s), {args.output_len} tokens, load {load_average():.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": asdict(args), "rounds": rows, "loadavg": os.getloadavg()}, f, indent=1)
    return 0
