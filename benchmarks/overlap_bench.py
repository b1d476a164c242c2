"""Per-step time through the four services, overlapped scheduling on vs off.

    python -m benchmarks.overlap_bench [--runs 3] [--streams 1,32] [--tokens 128]

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

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from benchmarks.serving.cpu_time import process_cpu_seconds
from benchmarks.serving.services_run import free_port, scrape
from services.common.pb.tokenmill.v1 import generation_pb2_grpc
from services.common.server import create_channel
from services.common.service_config import REPO_ROOT
from services.stack.client import build_request
from services.stack.launcher import LaunchConfig, Launcher

STORIES = str(REPO_ROOT / "models" / "stories260K")
PROMPTS = ["Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "One day, a little bird",
           "The sun was hot", "Ben saw a big", "Mom said"]


async def stream_step_ms(stub, prompt: str, tokens: int) -> float:
    """Milliseconds per token between this stream's first and last token."""
    request = build_request(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    async for message in stub.Generate(request, timeout=600):
        if message.WhichOneof("event") == "delta" and message.delta.token_ids:
            times.extend([time.perf_counter()] * len(message.delta.token_ids))
    if len(times) != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {len(times)}")
    return 1000 * (times[-1] - times[0]) / (tokens - 1)


def services_cpu_s(pids: list[int]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


EXECUTE = "tokenmill:executor_execute_seconds"


async def measure(address: str, executor_metrics: str, pids: list[int], streams: list[int],
                  tokens: int) -> dict[int, tuple[float, float, float]]:
    """Per stream count, per step: (wall ms, executor compute ms, CPU ms of the service processes)."""
    async with create_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
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
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)


def run_stack(overlap: bool, streams: list[int], tokens: int,
              kv_cache_bytes: int) -> dict[int, tuple[float, float, float]]:
    metrics_port = free_port()
    launcher = Launcher(LaunchConfig(
        model=STORIES, public_port=0, log_dir=tempfile.mkdtemp(prefix="overlap-bench-"),
        executor_args=[f"--kv-cache-bytes={kv_cache_bytes}", f"--metrics-port={metrics_port}"],
        scheduler_args=[] if overlap else ["--no-overlap-scheduling"],
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}, restart=False))
    launcher.start()
    pids = [launcher.services[name].process.pid for name in ("executor", "scheduler", "tokenizer")]
    try:
        return asyncio.run(measure(launcher.public_address, f"http://127.0.0.1:{metrics_port}/metrics", pids,
                                   streams, tokens))
    finally:
        launcher.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--kv-cache-bytes", type=int, default=32 * 1024**2)
    parser.add_argument("--max-load", type=float, default=0.0,
                        help="wait for the 1-minute load average to drop below this first (0 = do not wait)")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    results: dict[tuple[bool, int], list[tuple[float, float, float]]] = {}
    for run in range(args.runs):
        for overlap in ((True, False) if run % 2 == 0 else (False, True)):
            if args.max_load:
                wait_for_quiet(args.max_load)
            load = os.getloadavg()[0]
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


if __name__ == "__main__":
    main()
