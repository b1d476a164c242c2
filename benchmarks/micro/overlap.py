"""Per-step time through the four services, overlapped scheduling on vs off.

    python -m benchmarks overlap [--runs 3] [--streams 1,32] [--tokens 128]

For each run and each setting (on/off, alternating which goes first) the stack starts as
`tokenmill up` runs it (the Launcher: four processes, one OpenMP thread each, the scheduler
with or without --no-overlap-scheduling), answers one warm-up request, then for each stream
count S sends S greedy streams at once (distinct prompts, ignore_eos, --tokens each). All S
streams decode in lockstep, one token per step, so the per-step time is the time between a
stream's first and last token over (tokens - 1); the median over the streams is the run's
figure. Over the same stretch, per step: the executor's compute (ModelRunner.execute, from
its tokenmill:executor_execute_seconds metric), so wall - compute is the time the executor
sat idle waiting for the next plan; and the CPU time of the service processes (executor,
scheduler, tokenizer, from /proc): on a machine whose cores are busy with other work,
overlap can only show in the wall time when the services' own CPU per step does not grow.
The table gives the medians over runs per (setting, S) and the ratio off / on.
``--max-load`` waits (up to 10 minutes) for the 1-minute load average to drop below it
before each stack starts, for a shared machine.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.client import generation_stub, greedy_request, stream_ok
from benchmarks.harness.cpu import process_cpu_seconds
from benchmarks.harness.flags import setting
from benchmarks.harness.launch import LaunchSpec, launched
from benchmarks.harness.paths import STORIES as _STORIES
from benchmarks.harness.report import load_average
from benchmarks.harness.scrape import scrape

PROG = "python -m benchmarks overlap"
STORIES = str(_STORIES)
PROMPTS = ["Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "One day, a little bird",
           "The sun was hot", "Ben saw a big", "Mom said"]


@dataclass(frozen=True, slots=True)
class OverlapSettings:
    runs: int = setting(3)
    """Runs of each setting, alternating which goes first."""
    streams: tuple[int, ...] = setting((1, 32))
    """Stream counts, comma-separated."""
    tokens: int = setting(128)
    """Output tokens per stream."""
    kv_cache_bytes: int = setting(32 * 1024**2)
    """The executor's KV pool."""
    max_load: float = setting(0.0)
    """Wait for the 1-minute load average to drop below this first (0 = do not wait)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "runs")
        flags.check_at_least(self, 2, "tokens")


async def stream_step_ms(stub, prompt: str, tokens: int) -> float:
    """Milliseconds per token between this stream's first and last token."""
    record = await stream_ok(stub, greedy_request(prompt, tokens), timeout=600)
    if record.num_output_tokens != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {record.num_output_tokens}")
    return 1000 * record.tpot_s


def services_cpu_s(pids: list[int]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


EXECUTE = "tokenmill:executor_execute_seconds"


async def measure(address: str, executor_metrics: str, pids: list[int], streams: list[int],
                  tokens: int) -> dict[int, tuple[float, float, float]]:
    """Per stream count, per step: (wall ms, executor compute ms, CPU ms of the service processes)."""
    async with generation_stub(address) as stub:
        await stream_step_ms(stub, "Warm up", 16)
        out = {}
        for count in streams:
            prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(count)]
            cpu_before, before = services_cpu_s(pids), scrape(executor_metrics)
            per_stream = await asyncio.gather(*(stream_step_ms(stub, p, tokens) for p in prompts))
            cpu_after, after = services_cpu_s(pids), scrape(executor_metrics)
            steps = after[EXECUTE + "_count"] - before[EXECUTE + "_count"]
            compute_ms = 1000 * (after[EXECUTE + "_sum"] - before[EXECUTE + "_sum"]) / steps
            out[count] = (statistics.median(per_stream), compute_ms, 1000 * (cpu_after - cpu_before) / steps)
        return out


def wait_for_quiet(max_load: float) -> None:
    deadline = time.monotonic() + 600
    while load_average() >= max_load and time.monotonic() < deadline:
        time.sleep(5)


def run_stack(overlap: bool, streams: list[int], tokens: int,
              kv_cache_bytes: int) -> dict[int, tuple[float, float, float]]:
    launch = LaunchSpec(STORIES, (f"--kv-cache-bytes={kv_cache_bytes}",),
                        () if overlap else ("--no-overlap-scheduling",), threads=1, quiet=False,
                        log_prefix="overlap-bench-")
    with launched(launch) as stack:
        pids = [stack.pids[name] for name in ("executor", "scheduler", "tokenizer")]
        return asyncio.run(measure(stack.address, stack.executor_metrics, pids, streams, tokens))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(OverlapSettings, argv, prog=prog, description=__doc__)
    streams = list(args.streams)
    results: dict[tuple[bool, int], list[tuple[float, float, float]]] = {}
    for run in range(args.runs):
        for overlap in ((True, False) if run % 2 == 0 else (False, True)):
            if args.max_load:
                wait_for_quiet(args.max_load)
            load = load_average()
            for count, row in run_stack(overlap, streams, args.tokens, args.kv_cache_bytes).items():
                results.setdefault((overlap, count), []).append(row)
                print(f"run {run + 1}: overlap {'on ' if overlap else 'off'} {count:3d} streams: wall {row[0]:7.3f}, "
                      f"executor compute {row[1]:7.3f}, services CPU {row[2]:7.3f} ms/step (load {load:.1f})",
                      flush=True)
    print(f"\nmedians of {args.runs} runs, ms per step (one token per stream per step)")
    print(f"{'streams':>8} {'':>7} {'wall':>7} {'compute':>8} {'idle':>6} {'CPU':>7}")
    for count in streams:
        for overlap in (False, True):
            wall, compute, cpu = (statistics.median(x) for x in zip(*results[(overlap, count)]))
            print(f"{count:>8} {'on' if overlap else 'off':>7} {wall:7.3f} {compute:8.3f} {wall - compute:6.3f} {cpu:7.3f}")
        off = statistics.median(r[0] for r in results[(False, count)])
        on = statistics.median(r[0] for r in results[(True, count)])
        print(f"{count:>8} {'off/on':>7} {off / on:7.2f}")
    return 0
