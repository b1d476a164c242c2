"""Whom to preempt so that the waiting head can start: priority first, then fairness."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.scheduler.request.request import Request

FAIR_PREEMPTION_MARGIN = 0.5
"""A running request is preempted for a waiting tenant of its priority only when its own
tenant has been served this many max_model_len's of tokens more: tenants close to even never
preempt each other (no churn), while a tenant back from idle (credited one max_model_len
below the active ones, core/waiting_queue.py) takes a slot from a tenant that filled the batch."""


def victim_for(head: Request, running: Sequence[Request], served: Mapping[str, float],
               max_model_len: int) -> Request | None:
    """The running request to preempt for ``head``, or None: the least urgent running request
    if it is less urgent than the head (priority), else a request of the running tenant served
    the most, if that is more than FAIR_PREEMPTION_MARGIN * max_model_len tokens ahead of the
    head's tenant. ``running`` is sorted most urgent first."""
    least_urgent = running[-1]
    if least_urgent.priority > head.priority:
        return least_urgent
    margin = served.get(head.tenant, 0.0) + FAIR_PREEMPTION_MARGIN * max_model_len
    best = None
    for request in reversed(running):  # least urgent first
        if request.priority < head.priority or request.tenant == head.tenant:
            continue
        tenant_served = served.get(request.tenant, 0.0)
        if tenant_served > margin and (best is None or tenant_served > served.get(best.tenant, 0.0)):
            best = request
    return best
