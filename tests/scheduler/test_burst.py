"""BurstLength: the length of a multi-step burst from the measured decode step time."""

from __future__ import annotations

import math

import pytest

from services.scheduler.core.burst import BurstLength


def test_one_step_until_measured_then_as_many_as_fit_the_delay():
    burst = BurstLength(max_steps=16, max_delay_s=0.004)
    assert burst.steps == 1
    burst.observe(0.002, 1)
    assert burst.steps == 3  # the first token waits for 2 more 2 ms steps at most
    burst.observe(0.0, 4)  # not measured
    burst.observe(math.nan, 4)
    assert burst.decode_step_s == pytest.approx(0.002)


def test_the_estimate_is_per_forward_and_smoothed():
    burst = BurstLength(max_steps=64, max_delay_s=0.004, smoothing=0.5)
    burst.observe(0.004, 4)  # 1 ms a forward
    burst.observe(0.0001, 1)  # 0.1 ms: estimate halfway, 0.55 ms
    assert burst.decode_step_s == pytest.approx(0.00055)
    assert burst.steps == 1 + 7


@pytest.mark.parametrize(("step_s", "steps"), [(1e-6, 16), (0.0005, 9), (0.004, 2), (0.0041, 1), (1.0, 1)])
def test_capped_at_max_steps_and_never_below_one(step_s, steps):
    burst = BurstLength(max_steps=16, max_delay_s=0.004)
    burst.observe(step_s, 1)
    assert burst.steps == steps


def test_without_a_delay_budget_or_without_bursts_the_cap_is_the_answer():
    assert BurstLength(max_steps=8, max_delay_s=0).steps == 8
    one = BurstLength(max_steps=1, max_delay_s=0.004)
    one.observe(1e-6, 1)
    assert one.steps == 1
