"""The bounded queue at the door (services/scheduler/admission.py): bounds, per-tenant bounds
and the pushback computed from the measured drain rate, on an injected clock."""

from __future__ import annotations

import pytest

from services.common.errors import ResourceExhaustedError
from services.scheduler.admission import (
    MAX_PUSHBACK_S, MIN_PUSHBACK_S, UNMEASURED_PUSHBACK_S, Admission, DrainRate, per_tenant_bound)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_overall_bound_refuses_with_the_limit_named_and_frees_on_leave() -> None:
    admission = Admission(2, clock=Clock())
    a, b = admission.enter(), admission.enter()
    with pytest.raises(ResourceExhaustedError, match="max_waiting_requests=2") as refused:
        admission.enter()
    assert refused.value.retry_after_s == UNMEASURED_PUSHBACK_S  # nothing drained yet
    admission.leave(a)
    admission.leave(a)  # twice: counted once
    assert admission.queued == 1
    admission.enter()
    assert admission.queued == 2 and admission.rejected == 1
    admission.leave(b)


def test_per_tenant_bound_leaves_other_tenants_room() -> None:
    admission = Admission(10, max_queued_per_tenant=2, clock=Clock())
    places = [admission.enter("flood"), admission.enter("flood")]
    with pytest.raises(ResourceExhaustedError, match="tenant 'flood' has 2 requests queued, max_waiting_per_tenant=2"):
        admission.enter("flood")
    admission.enter("quiet")
    for _ in range(5):
        admission.enter("")  # no tenant (authentication off): only the overall bound
    admission.leave(places[0])
    admission.enter("flood")
    assert admission.per_tenant == {"flood": 2, "quiet": 1, "": 5}


def test_pushback_is_the_places_ahead_over_the_drain_rate() -> None:
    clock = Clock()
    admission = Admission(4, clock=clock)
    places = [admission.enter() for _ in range(4)]
    for place in places[:2]:  # two leave, 1 s apart: 2 within the 1 s observed (at least 1 s counts)
        clock.now += 1.0
        admission.leave(place)
    admission.enter()
    admission.enter()
    with pytest.raises(ResourceExhaustedError) as refused:
        admission.enter()
    assert refused.value.retry_after_s == pytest.approx(4 / 2.0)
    assert admission.pushback_s(0) == MIN_PUSHBACK_S
    assert admission.pushback_s(10**6) == MAX_PUSHBACK_S


def test_drain_rate_forgets_outside_its_window() -> None:
    rate = DrainRate(window_s=10.0)
    assert rate.per_second(0.0) is None
    for t in range(20):
        rate.record(float(t))
    assert rate.per_second(19.0) == pytest.approx(11 / 10.0)  # t = 9..19 within the window
    assert rate.per_second(40.0) is None


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_queued must be >= 1"):
        Admission(0)
    with pytest.raises(ValueError, match="max_queued_per_tenant must be >= 0"):
        Admission(1, -1)


def test_with_authentication_each_tenant_gets_a_share_of_the_queue_by_default():
    assert per_tenant_bound(0, 4096, 0) == 0  # no authentication: only the overall bound
    assert per_tenant_bound(0, 4096, 1) == 0  # one tenant may use it all
    assert per_tenant_bound(0, 4096, 2) == 2048
    assert per_tenant_bound(0, 4096, 100) == 1024  # never below a quarter
    assert per_tenant_bound(0, 3, 4) == 1
    assert per_tenant_bound(7, 4096, 100) == 7 and per_tenant_bound(-1, 4096, 100) == 0
