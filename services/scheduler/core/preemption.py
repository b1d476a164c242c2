"""Preemption by recompute: whom to preempt so that the waiting head can start (priority
first, then fairness), and what preempting does to a request of one scheduler core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from services.scheduler.request.request import Request, RequestStatus

if TYPE_CHECKING:
    from services.common.step import StepPlan
    from services.scheduler.core.block_manager import BlockManager
    from services.scheduler.core.config import SchedulerConfig
    from services.scheduler.core.waiting_queue import WaitingQueue

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


class Preemption:
    """Takes running requests of one scheduler core (its own ``running``, most urgent first) back
    to its waiting queue, blocks freed; each victim's seq id goes to the plan's finished ids."""

    def __init__(self, running: list[Request], waiting: WaitingQueue, block_manager: BlockManager,
                 config: SchedulerConfig) -> None:
        self._running = running
        self._waiting = waiting
        self._block_manager = block_manager
        self._config = config
        self.count = 0
        """Requests preempted, since start."""

    def for_waiting_head(self, plan: StepPlan) -> None:
        """Make room for the waiting head when it has none (blocks or max_num_seqs), by
        preempting running requests (recompute: they restart later from their known tokens,
        so their outputs are unchanged). The head starts in the same step; the victims wait
        at least until the next.

        Victims, one at a time until the head fits: ``victim_for``'s. Done before anything is
        planned, so no victim is also in this plan."""
        head, running = self._waiting.peek(), self._running
        if head is None or not running:
            return
        # The blocks its prompt needs plus one token (no prefix hit assumed: cautious).
        needed = -(-(head.num_tokens + 1) // self._config.block_size)
        while running and (len(running) >= self._config.limits.max_num_seqs
                           or self._block_manager.pool.num_free < needed):
            victim = victim_for(head, running, self._waiting.served, self._config.max_model_len)
            if victim is None:
                break
            running.remove(victim)
            self._preempt(victim, plan)

    def allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> list[int] | None:
        """Blocks for ``num_new`` more tokens of a running request, preempting the least urgent
        running requests until they fit; None when ``request`` itself was the one preempted."""
        while True:
            new_block_ids = self._block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            # running is sorted most urgent first, and requests before `request` were already
            # scheduled this step, so the victim is the last one (maybe `request`).
            victim = self._running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Drop its blocks; it restarts from its known tokens. Its full blocks keep their
        prefix-cache hashes, so unless evicted meanwhile the restart is mostly prefix hits."""
        self._block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.forget_in_flight()  # a step in flight for it is ignored at its update()
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.count += 1
        self._waiting.push(request)
        plan.finished_seq_ids.append(request.seq_id)
