"""LatencyProfileRecorder over a fake clock: exact percentiles, window edges, rates."""

from __future__ import annotations

import tracemalloc

import pytest

from services.common.errors import InvalidArgumentError
from services.common.generation import GenerationDelta, Timings, Usage
from services.scheduler.core.outputs import SchedulerStats
from services.scheduler.profile import FinishedSample, LatencyProfileRecorder, percentile


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


def test_to_proto_adds_live_gauges():
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=30.0, clock=clock)
    clock.now += 30.0
    recorder.on_finished(finished(12.0, 40.0, 5))
    stats = SchedulerStats(num_running=3, num_waiting=4, num_preemptions=0, kv_cache_usage=0.25,
                           num_free_blocks=30, num_blocks=40, prefix_cache_queries=0, prefix_cache_hits=0)
    msg = recorder.to_proto(None, stats)
    assert (msg.window_seconds, msg.num_requests, msg.max_output_tokens) == (30.0, 1, 5)
    assert msg.ttft_p50_ms == 12.0 and msg.tpot_p50_ms == 10.0
    assert msg.tokens_per_second_per_stream == pytest.approx(100.0)
    assert msg.tokens_per_second_total == pytest.approx(5 / 30.0)
    assert (msg.kv_cache_usage, msg.num_running, msg.num_waiting) == (0.25, 3, 4)
    empty = recorder.to_proto(10.0, None)
    assert (empty.num_running, empty.kv_cache_usage) == (0, 0.0)


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
    bounded = LatencyProfileRecorder(window_s=30.0, clock=clock, retention_s=600.0, max_samples=100)
    for i in range(1000):
        bounded.record(FinishedSample(clock.now, 0.01, 0.1, 2, 0.2))
    assert len(bounded) == 100 and bounded.snapshot().num_requests == 100


def test_a_retained_sample_costs_about_its_five_doubles():
    # The scheduler keeps up to 600 s of samples: stored as objects they cost ~180 bytes each
    # and grew its resident memory by MiB under load; as rows of doubles, 40 bytes.
    clock = FakeClock()
    recorder = LatencyProfileRecorder(window_s=60.0, clock=clock, retention_s=600.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            clock.now = 1000.0 + i / 100
            recorder.record(FinishedSample(clock.now, 0.012 + i * 1e-9, 0.3 + i * 1e-9, 17 + i % 5, 0.4 + i * 1e-9))
        per_sample = (tracemalloc.get_traced_memory()[0] - before) / 20_000
    finally:
        tracemalloc.stop()
    assert len(recorder) == 20_000
    assert per_sample < 64, per_sample
