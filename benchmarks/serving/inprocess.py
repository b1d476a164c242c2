"""System (b): the in-process Engine (scheduler core + model runner in this process, no gRPC).

The driver adds requests as the workload allows (closed loop: keep ``concurrency`` in
flight; Poisson: when their arrival time has passed, capped by ``concurrency``) and calls
``engine.step()`` until everything finished. Each step is timed, and the model runner's
execute() inside it, so the report can say how much of a step is compute and how much is
the Python around it (schedule, update, detokenization, stop checks).
"""

from __future__ import annotations

import gc
import time
from collections import deque

from benchmarks.harness.engine import greedy, warm_up
from benchmarks.harness.records import KVSample, RequestRecord, SystemRun
from benchmarks.serving.workload import BenchRequest
from services.inprocess.engine import Engine
from services.scheduler.core.kv_slots import kv_slot_usage


class _TimedExecute:
    """Stands in for engine.runner.execute: sums its wall time and the sequences it ran."""

    def __init__(self, execute) -> None:
        self.execute = execute
        self.seconds = 0.0
        self.calls = 0
        self.sequences = 0

    def __call__(self, plan):
        self.sequences += len(plan.new) + len(plan.running)
        start = time.perf_counter()
        try:
            return self.execute(plan)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run_inprocess(engine: Engine, requests: list[BenchRequest], concurrency: int, progress=None) -> SystemRun:
    """Drive ``engine`` (built from the run's EngineSettings) through the workload."""
    warm_up(engine)
    timer = _TimedExecute(engine.runner.execute)
    engine.runner.execute = timer
    block_size = engine.scheduler.config.block_size
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    records: dict[str, RequestRecord] = {}
    kv_samples: list[KVSample] = []
    in_flight = steps = 0
    step_seconds = 0.0
    gc.collect()
    cpu_start = time.process_time()
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and in_flight < concurrency and pending[0].arrival_s <= now - start:
            request = pending.popleft()
            sampling, stop = greedy(request.output_len)
            request_id = f"bench-{request.index}"
            engine.add_request(list(request.prompt_ids), sampling, stop, request_id=request_id)
            records[request_id] = RequestRecord(request.index, len(request.prompt_ids), request.output_len,
                                                time.perf_counter())
            in_flight += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - start)))
            continue
        step_start = time.perf_counter()
        deltas = engine.step()
        done = time.perf_counter()
        step_seconds += done - step_start
        steps += 1
        for delta in deltas:
            record = records[delta.request_id]
            record.add_chunk(done, delta.token_ids)
            if delta.finished:
                record.finish_time = done
                in_flight -= 1
                if progress is not None:
                    progress.update(1)
        slots = kv_slot_usage(engine.scheduler.running, block_size)
        kv_samples.append(KVSample(done, engine.scheduler.block_manager.pool.usage, slots.waste_fraction,
                                   len(engine.scheduler.running)))
    end = time.perf_counter()
    ordered = sorted(records.values(), key=lambda r: r.index)
    extra = {"cpu_seconds": time.process_time() - cpu_start, "step_breakdown": {
        "steps": steps,
        "mean_batch_size": timer.sequences / timer.calls if timer.calls else 0.0,
        "step_wall_ms_mean": 1000 * step_seconds / steps if steps else 0.0,
        "execute_ms_mean": 1000 * timer.seconds / steps if steps else 0.0,
        "engine_python_ms_mean": 1000 * (step_seconds - timer.seconds) / steps if steps else 0.0,
        "driver_ms_mean": 1000 * ((end - start) - step_seconds) / steps if steps else 0.0,
        "execute_fraction_of_wall": timer.seconds / (end - start) if end > start else 0.0,
    }}
    del engine
    gc.collect()
    return SystemRun("tokenmill in-process", ordered, start, end, kv_samples, extra=extra)
