"""GetProfile's snapshots under a loop of calls (services/scheduler/profile_cache.py): exact while
the calls come at an ordinary rate, at most MAX_FRESH_PER_S computed in any second however the
windows vary, and a window never answered before refused with a pushback beyond that."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.latency_profile import FinishedSample, LatencyProfileRecorder
from services.scheduler.profile_cache import MAX_FRESH_PER_S, ProfileCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample(at: float) -> FinishedSample:
    return FinishedSample(finish_time=at, ttft_s=0.01, decode_s=0.1, completion_tokens=11, e2e_s=0.11)


def make() -> tuple[ProfileCache, LatencyProfileRecorder, Clock]:
    clock = Clock()
    recorder = LatencyProfileRecorder(window_s=60.0, clock=clock, retention_s=600.0)
    return ProfileCache(recorder, clock=clock), recorder, clock


def test_a_snapshot_is_reused_until_a_request_finishes_or_it_ages():
    cache, recorder, clock = make()
    recorder.record(sample(clock.now))
    first = cache.snapshot(300.0)
    for _ in range(1000):
        assert cache.snapshot(300.0) is first
    assert cache.computed == 1
    recorder.record(sample(clock.now))  # a request finished: the next answer is exact
    assert cache.snapshot(300.0).num_requests == 2 and cache.computed == 2
    clock.now += 1.0
    cache.snapshot(300.0)
    assert cache.computed == 3


def test_varying_windows_compute_at_most_the_cap_a_second():
    cache, recorder, clock = make()
    recorder.record(sample(clock.now))
    answered = refused = 0
    for i in range(1000):
        try:
            cache.snapshot(1.0 + i)
            answered += 1
        except ResourceExhaustedError as error:
            refused += 1
            assert 0 < error.retry_after_s <= 1.0
            assert str(error).startswith(f"GetProfile computes at most {MAX_FRESH_PER_S} new windows a second")
    assert cache.computed == answered == MAX_FRESH_PER_S and refused == 1000 - MAX_FRESH_PER_S
    recorder.record(sample(clock.now))
    assert cache.snapshot(1.0).num_requests == 1  # over the cap, a known window gets its last answer
    clock.now += 1.0
    assert cache.snapshot(1.0).num_requests == 2  # and an exact one once the second is over


def test_bad_windows_are_refused_before_anything_is_computed():
    cache, _, _ = make()
    for window in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="window_seconds must be a positive number"):
            cache.snapshot(window)
    assert cache.computed == 0
