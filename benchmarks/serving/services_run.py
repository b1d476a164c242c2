"""System (a): tokenmill through the four services, driven over gRPC like any client.

Either the stack the run launched (harness.launch: public port 0, metrics on free ports) or
a running one (``address``). Requests stream over one channel; a sampler polls GetProfile
(KV usage, running, waiting) and, when the scheduler's metrics endpoint is known, its
kv_cache_waste_perc gauge. Before and after the run the scheduler's and executor's /metrics
are read: the differences give the step breakdown (steps, time by phase at the scheduler,
compute time at the executor).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import uvloop

from benchmarks.harness.client import generation_stub, greedy_request, stream
from benchmarks.harness.cpu import CpuMeter
from benchmarks.harness.launch import Stack
from benchmarks.harness.records import KVSample, RequestRecord, SystemRun
from benchmarks.harness.scrape import moved as scrape_moved, scrape
from benchmarks.serving.workload import BenchRequest
from services.common.pb.tokenmill.v1 import generation_pb2

SAMPLE_INTERVAL_S = 0.5
"""KV usage/waste sampling period. Sampling is work for the scheduler and this client, on the
cores the executor computes on: at 0.1 s with full /metrics scrapes it took about a third of
the scheduler's CPU and slowed the executor measurably with two threads."""
FIRST_SAMPLES_INTERVAL_S = 0.02
FIRST_SAMPLES_WINDOW_S = 2.0
"""The first seconds are sampled densely, so a run shorter than SAMPLE_INTERVAL_S (a smoke
test) still sees its requests running; it costs a long run nothing that shows. A smoke run
of four short requests lasts about 0.1 s with overlapped scheduling, so the interval is well
below that."""
KV_WASTE_METRIC = "tokenmill:kv_cache_waste_perc"


async def _one(stub, request: BenchRequest, record: RequestRecord, on_first_token=None) -> None:
    await stream(stub, greedy_request(list(request.prompt_ids), request.output_len), record,
                 on_first_token=on_first_token)


async def _sample(stub, stack: Stack, samples: list[KVSample], stop: asyncio.Event, wake: asyncio.Event) -> None:
    """Polls GetProfile, and at once whenever ``wake`` is set (a request's first token: it holds
    KV blocks now), so a run shorter than the polling interval still sees its peak."""
    started = time.perf_counter()
    while not stop.is_set():
        wake.clear()
        try:
            profile = await stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=5)
            waste = None
            if stack.scheduler_metrics is not None:
                metrics = await asyncio.to_thread(scrape, stack.scheduler_metrics, (KV_WASTE_METRIC,))
                waste = metrics.get(KV_WASTE_METRIC)
            samples.append(KVSample(time.perf_counter(), profile.kv_cache_usage, waste, profile.num_running))
        except (grpc.aio.AioRpcError, OSError):
            pass  # a missed sample is not worth failing the run for
        try:
            early = time.perf_counter() - started < FIRST_SAMPLES_WINDOW_S
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
            await asyncio.wait(waiters, timeout=FIRST_SAMPLES_INTERVAL_S if early else SAMPLE_INTERVAL_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


async def _run(stack: Stack, requests: list[BenchRequest], concurrency: int, progress) -> SystemRun:
    async with generation_stub(stack.address) as stub:
        await _one(stub, BenchRequest(-1, (5, 6, 7, 8), 4, 0.0), RequestRecord(-1, 4, 4, time.perf_counter()))
        # The scheduler records a finished request in its profile just after sending its last
        # event, and answers windows rounded to 0.1 s (services/scheduler/profile_cache.py):
        # wait until the warm-up is recorded, then past that rounding, so that a run shorter
        # than 0.1 s does not count it.
        for _ in range(200):
            profile = await stub.GetProfile(generation_pb2.GetProfileRequest(window_seconds=600), timeout=10)
            if profile.num_requests >= 1:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        before = [await asyncio.to_thread(scrape, url) for url in (stack.scheduler_metrics, stack.executor_metrics)]
        records = {r.index: RequestRecord(r.index, len(r.prompt_ids), r.output_len, 0.0) for r in requests}
        slots = asyncio.Semaphore(concurrency)
        samples: list[KVSample] = []
        stop = asyncio.Event()
        wake = asyncio.Event()
        cpu = CpuMeter(stack.pids.values())
        cpu.start()
        start = time.perf_counter()
        sampler = asyncio.create_task(_sample(stub, stack, samples, stop, wake))

        async def send(request: BenchRequest) -> None:
            delay = request.arrival_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                record = records[request.index]
                record.send_time = time.perf_counter()
                await _one(stub, request, record, wake.set)
                if progress is not None:
                    progress.update(1)

        await asyncio.gather(*(send(r) for r in sorted(requests, key=lambda r: r.arrival_s)))
        end = time.perf_counter()
        cpu.stop()
        stop.set()
        await sampler
        after = [await asyncio.to_thread(scrape, url) for url in (stack.scheduler_metrics, stack.executor_metrics)]
        # The window reaches back to just after `start`: the warm-up request stays out of it.
        profile = await stub.GetProfile(
            generation_pb2.GetProfileRequest(window_seconds=time.perf_counter() - start), timeout=10)
    extra = {"server_profile": {
        "num_requests": profile.num_requests, "ttft_p50_ms": profile.ttft_p50_ms, "ttft_p99_ms": profile.ttft_p99_ms,
        "tpot_p50_ms": profile.tpot_p50_ms, "tpot_p99_ms": profile.tpot_p99_ms,
        "tokens_per_second_total": profile.tokens_per_second_total,
        "tokens_per_second_per_stream": profile.tokens_per_second_per_stream}}
    if stack.pids:
        extra["cpu_seconds"] = cpu.seconds
        extra["client_cpu_seconds"] = cpu.own_seconds
        extra["cpu_seconds_by_service"] = {name: cpu.by_pid.get(pid) for name, pid in stack.pids.items()}
    breakdown = step_breakdown(before, after, end - start)
    if breakdown is not None:
        extra["step_breakdown"] = breakdown
    return SystemRun("tokenmill services", [records[r.index] for r in sorted(requests, key=lambda r: r.index)],
                     start, end, samples, extra=extra)


def step_breakdown(before: list[dict], after: list[dict], duration_s: float) -> dict | None:
    """Per-step figures from the scheduler's (index 0) and executor's (1) counters over the run."""
    def moved(index: int, name: str) -> float:
        return scrape_moved(before[index], after[index], name)

    steps = moved(0, "tokenmill:scheduler_steps_total")
    if steps <= 0:
        return None
    phase = 'tokenmill:scheduler_step_phase_seconds_total{phase="%s"}'
    schedule_s, executor_s, update_s = (moved(0, phase % p) for p in ("schedule", "executor", "update"))
    out = {
        "steps": int(steps),
        "mean_batch_size": moved(0, "tokenmill:scheduler_step_sequences_total") / steps,
        "step_wall_ms_mean": 1000 * duration_s / steps,
        "schedule_ms_mean": 1000 * schedule_s / steps,
        "executor_round_trip_ms_mean": 1000 * executor_s / steps,
        "update_ms_mean": 1000 * update_s / steps,
        "loop_other_ms_mean": 1000 * (duration_s - schedule_s - executor_s - update_s) / steps,
    }
    executed = moved(1, "tokenmill:executor_execute_seconds_count")
    if executed > 0:
        # Per scheduler step, like every other figure here, so the parts add up to the wall time.
        execute_s = moved(1, "tokenmill:executor_execute_seconds_sum")
        out["executor_steps"] = int(executed)
        out["execute_ms_mean"] = 1000 * execute_s / steps
        out["round_trip_overhead_ms_mean"] = 1000 * (executor_s - execute_s) / steps
        out["execute_fraction_of_wall"] = execute_s / duration_s if duration_s > 0 else 0.0
    return out


def run_services(stack: Stack, requests: list[BenchRequest], concurrency: int, progress=None) -> SystemRun:
    # uvloop, as the services use: the client shares the cores with the stack it measures.
    run = uvloop.run(_run(stack, requests, concurrency, progress))
    if stack.log_dir:
        run.notes.append(f"service logs: {stack.log_dir}")
    return run
