"""LatencyProfileRecorder over a fake clock: exact percentiles, window edges, rates."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from services.common.errors import InvalidArgumentError
from services.scheduler.request.delta import GenerationDelta, Timings, Usage
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.engine.handoff import TransferCounters
from services.scheduler.generation_codec import profile_to_proto
from services.common.percentile import percentile
from services.common.latency_profile import FinishedSample, LatencyProfileRecorder


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def finished(ttft_ms: float, decode_ms: float, tokens: int) -> GenerationDelta:
    return GenerationDelta("r", finish_reason="length", usage=Usage(10, tokens, 0),
                           timings=Timings(1.0, ttft_ms, decode_ms, ttft_ms + decode_ms))


def test_percentile_interpolates_between_ranks():
    values = [40.0, 10.0, 30.0, 20.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 50) == 25.0  # mean of the middle two
    assert percentile(values, 100) == 40.0
    assert percentile(values, 99) == pytest.approx(30.0 + 10.0 * 0.97)  # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError, match="percentile q"):
        percentile(values, 101)


def test_snapshot_exact_statistics():
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=60.0, clock=clock)
    clock.now += 100.0  # older than the window: the rate divides by the full window
    # TTFT 100..1000 ms; decode 9 tokens after the first over 90 ms * i -> TPOT 10*i ms.
    for i in range(1, 11):
        recorder.on_finished(finished(100.0 * i, 90.0 * i, 10))
        clock.now += 1.0
    snap = recorder.snapshot()
    assert snap.num_requests == 10
    assert snap.window_s == 60.0
    assert snap.ttft_p50_ms == pytest.approx(550.0)
    assert snap.ttft_p99_ms == pytest.approx(991.0)  # 900 + 100 * 0.91
    assert snap.tpot_p50_ms == pytest.approx(55.0)
    assert snap.tpot_p99_ms == pytest.approx(99.1)
    # per-stream speed: 9 tokens / (0.09 i s) = 100/i tokens/s; median of i=1..10 -> mean of 100/5 and 100/6
    assert snap.tokens_per_s_per_stream == pytest.approx((100 / 5 + 100 / 6) / 2)
    assert snap.tokens_per_s_total == pytest.approx(100 / 60.0)
    assert snap.max_output_tokens == 10


def test_window_drops_old_samples_and_young_recorder_uses_its_age():
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=10.0, clock=clock, retention_s=100.0)
    clock.now += 2.0
    recorder.on_finished(finished(50.0, 20.0, 5))  # t = 2
    clock.now += 2.0
    # Only 4 s old: 5 tokens over 4 s, not over the 10 s window.
    assert recorder.snapshot().tokens_per_s_total == pytest.approx(5 / 4.0)
    clock.now += 7.0
    recorder.on_finished(finished(80.0, 30.0, 7))  # t = 11
    clock.now += 2.0  # t = 13: the first sample (t = 2) is 11 s old, out of the 10 s window
    snap = recorder.snapshot()
    assert snap.num_requests == 1
    assert snap.ttft_p50_ms == 80.0
    assert snap.tpot_p99_ms == pytest.approx(5.0)
    assert snap.tokens_per_s_total == pytest.approx(7 / 10.0)
    # A longer window asked for at query time still sees both (retention 100 s).
    wide = recorder.snapshot(50.0)
    assert wide.num_requests == 2
    assert wide.window_s == 50.0
    assert wide.tokens_per_s_total == pytest.approx(12 / 13.0)
    # Beyond the retention the window is clamped and says so.
    assert recorder.snapshot(1000.0).window_s == 100.0


def test_requests_without_tokens_or_second_token():
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=60.0, clock=clock)
    recorder.on_finished(GenerationDelta("a", finish_reason="abort", usage=Usage(3, 0, 0),
                                         timings=Timings(5.0, 5.0, 0.0, 5.0)))
    recorder.on_finished(finished(30.0, 0.0, 1))
    snap = recorder.snapshot()
    assert snap.num_requests == 1  # the aborted request has no TTFT and leaves no sample
    assert snap.ttft_p50_ms == 30.0
    assert snap.tpot_p50_ms == 0.0 and snap.tokens_per_s_per_stream == 0.0
    assert FinishedSample(0.0, 0.03, 0.0, 1, 0.03).tpot_s is None


def test_bad_windows_are_rejected():
    with pytest.raises(ValueError, match="window_s"):
        LatencyProfileRecorder(window_s=0)
    recorder = LatencyProfileRecorder(window_s=5.0, clock=FakeClock())
    with pytest.raises(InvalidArgumentError, match="window_seconds"):
        recorder.snapshot(-1.0)


def test_the_proto_adds_live_gauges_and_each_executor():
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=30.0, clock=clock)
    clock.now += 30.0
    recorder.on_finished(finished(12.0, 40.0, 5))
    stats = SchedulerStats(num_running=3, num_waiting=4, num_preemptions=0, kv_cache_usage=0.25,
                           num_free_blocks=30, num_blocks=40, prefix_cache_queries=0, prefix_cache_hits=0)
    copies = TransferCounters(transfers=2, blocks=6, bytes=6000, seconds=0.5, failures=1)
    msg = profile_to_proto(recorder.snapshot(None), stats, [("a:1", "decode", stats, copies), ("b:2", "mixed", stats, None)])
    assert (msg.window_seconds, msg.num_requests, msg.max_output_tokens) == (30.0, 1, 5)
    assert msg.ttft_p50_ms == 12.0 and msg.tpot_p50_ms == 10.0
    assert msg.tokens_per_second_per_stream == pytest.approx(100.0)
    assert msg.tokens_per_second_total == pytest.approx(5 / 30.0)
    assert (msg.kv_cache_usage, msg.num_running, msg.num_waiting) == (0.25, 3, 4)
    assert [(e.name, e.role, e.num_running, e.kv_transfers, e.kv_transfer_bytes, e.kv_transfer_failures)
            for e in msg.executors] == [("a:1", "decode", 3, 2, 6000, 1), ("b:2", "mixed", 3, 0, 0, 0)]
    empty = profile_to_proto(recorder.snapshot(10.0), None, [])
    assert (empty.num_running, empty.kv_cache_usage, len(empty.executors)) == (0, 0.0, 0)


def test_retention_with_compaction_keeps_exactly_the_recent_samples_and_bounds_the_count():
    # 10 samples a second for 300 s against a 60 s retention: rows expire and are cut off in
    # bulk many times; every query must see exactly the samples a plain list would.
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=30.0, clock=clock, retention_s=60.0)
    kept: list[FinishedSample] = []
    for i in range(3000):
        clock.now = 1000.0 + i / 10
        sample = FinishedSample(clock.now, 0.001 * (i % 97), 0.01 * (i % 13), 1 + i % 7, 0.5)
        recorder.record(sample)
        kept.append(sample)
        if i % 250 == 0:
            for window in (1.0, 30.0, 60.0):
                want = [s for s in kept if s.finish_time >= clock.now - window]
                snap = recorder.snapshot(window)
                assert snap.num_requests == len(want)
                assert snap.ttft_p99_ms == pytest.approx(percentile([s.ttft_s * 1000 for s in want], 99))
                assert snap.max_output_tokens == max(s.completion_tokens for s in want)
    assert len(recorder) == len([s for s in kept if s.finish_time >= clock.now - 60.0]) in (600, 601)
    bounded = LatencyProfileRecorder(window_s=30.0, clock=clock, retention_s=600.0, capacity=100)
    for i in range(1000):
        bounded.record(FinishedSample(clock.now, 0.01, 0.1, 2, 0.2))
    assert len(bounded) == 100 and bounded.snapshot().num_requests == 100


def test_the_ring_is_allocated_once_and_recording_allocates_nothing_that_stays():
    # The scheduler keeps up to 600 s of samples: as objects (~180 bytes each), and later in a
    # growing array, they grew its resident memory by MiB under load. The ring costs its five
    # doubles a sample once, when it is made, and feeding it past its capacity adds nothing.
    clock = FakeClock()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        recorder = LatencyProfileRecorder(window_s=60.0, clock=clock, retention_s=600.0, capacity=20_000)
        made = tracemalloc.get_traced_memory()[0]
        for i in range(3 * 20_000):
            clock.now = 1000.0 + i / 100
            recorder.record(FinishedSample(clock.now, 0.012 + i * 1e-9, 0.3 + i * 1e-9, 17 + i % 5, 0.4 + i * 1e-9))
        fed = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 40 * 20_000 <= made - before < 40 * 20_000 + 4096, made - before
    assert fed - made < 4096, fed - made
    assert len(recorder) == 20_000


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


_RESIDENT_CHECK = """
from tests.scheduler.test_profile import FakeClock, _rss_kib
from services.scheduler.engine.handoff import TransferCounters
from services.scheduler.generation_codec import profile_to_proto
from services.common.latency_profile import LatencyProfileRecorder
before = _rss_kib()
recorder = LatencyProfileRecorder(window_s=60.0, clock=FakeClock(), capacity=500_000)  # 20 MB
print(_rss_kib() - before, recorder.capacity)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from Linux's /proc")
def test_the_ring_is_resident_from_the_start():
    # Touched when made, so the process's resident memory does not creep up as it fills.
    # In a fresh interpreter: in this one, pages freed by earlier tests may be reused.
    done = subprocess.run([sys.executable, "-c", _RESIDENT_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    grown, capacity = map(int, done.stdout.split())
    assert grown >= 0.9 * 40 * 500_000 / 1024, grown
    assert capacity == 500_000


def test_a_wrapped_ring_answers_over_the_span_it_holds_and_says_so():
    clock = FakeClock(0.0)
    recorder = LatencyProfileRecorder(window_s=60.0, clock=clock, retention_s=600.0, capacity=50)
    for i in range(200):  # 10 a second for 20 s: the ring holds the last 5 s
        clock.now = i / 10
        recorder.record(FinishedSample(clock.now, 0.001 * (i + 1), 0.01 * (i % 7), 2 + i % 3, 0.5))
    clock.now = 20.0
    snap = recorder.snapshot()
    newest_lost = 149 / 10
    assert snap.num_requests == 50
    assert snap.window_s == pytest.approx(20.0 - newest_lost)  # not the 60 s asked for
    assert snap.ttft_p50_ms == pytest.approx(percentile([float(i + 1) for i in range(150, 200)], 50))
    assert snap.tokens_per_s_total == pytest.approx(sum(2 + i % 3 for i in range(150, 200)) / (20.0 - newest_lost))
    # A window inside what the ring holds is whole.
    short = recorder.snapshot(2.0)
    assert short.window_s == 2.0 and short.num_requests == 20
    # Once the overwritten samples are older than the window, answers are whole again.
    clock.now = 20.0 + 60.0
    recorder.record(FinishedSample(clock.now, 0.02, 0.1, 3, 0.2))
    assert recorder.snapshot().window_s == 60.0 and recorder.snapshot().num_requests == 1
    # The sample just recorded overwrote the one of t = 15.0, which a 600 s window reaches.
    assert recorder.snapshot(600.0).window_s == pytest.approx(80.0 - 15.0)


def test_wrapping_ring_matches_a_plain_list_over_random_windows():
    # Against the obvious model: the last `capacity` samples, and a window is cut short exactly
    # when the newest overwritten sample lies inside it.
    rng = random.Random(7)
    clock = FakeClock(0.0)
    capacity, retention = 64, 30.0
    recorder = LatencyProfileRecorder(window_s=10.0, clock=clock, retention_s=retention, capacity=capacity)
    samples: list[FinishedSample] = []
    for i in range(2000):
        clock.now += rng.choice((0.0, 0.01, 0.05, 0.2, 1.0, 4.0))  # bursts, ties and quiet spells
        sample = FinishedSample(clock.now, rng.uniform(0.001, 0.5), rng.uniform(0.0, 2.0), rng.randint(1, 50), 1.0)
        recorder.record(sample)
        samples.append(sample)
        if i % 7:
            continue
        clock.now += rng.choice((0.0, 0.5, 3.0))
        for window in (0.3, 2.0, 10.0, 45.0):
            asked = min(window, retention)
            start = clock.now - asked
            want = [s for s in samples[-capacity:] if s.finish_time >= start]
            wrapped = len(samples) > capacity and samples[-capacity - 1].finish_time >= start
            snap = recorder.snapshot(window)
            assert snap.num_requests == len(want)
            want_window = clock.now - samples[-capacity - 1].finish_time if wrapped else asked
            assert snap.window_s == pytest.approx(want_window)
            assert snap.ttft_p99_ms == pytest.approx(percentile([s.ttft_s * 1000 for s in want], 99))
            assert snap.tpot_p50_ms == pytest.approx(percentile([s.tpot_s * 1000 for s in want
                                                                 if s.tpot_s is not None], 50))
            assert snap.max_output_tokens == max((s.completion_tokens for s in want), default=0)
            covered = want_window if wrapped else min(asked, clock.now - 0.0)
            rate = sum(s.completion_tokens for s in want) / covered if covered > 0 else 0.0
            assert snap.tokens_per_s_total == pytest.approx(rate)
    assert len(recorder) <= capacity


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        LatencyProfileRecorder(capacity=0)
