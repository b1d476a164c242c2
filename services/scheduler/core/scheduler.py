"""The scheduling policy: turns request state into a StepPlan, and a StepResult back into state.

One rule drives everything: each request's ``num_computed_tokens`` catches up with its
``num_tokens``. A step gives some requests a number of tokens to compute within a token
budget; a whole prompt, a prefill chunk, a decode token and 1 + k speculative tokens differ
only in that number. Pure state machine: no I/O, no clock, no torch. Callers drive it as

    plan = scheduler.schedule()
    result = executor.step(plan)        # send plan.finished_seq_ids even when plan.is_empty
    updates = scheduler.update(plan, result)

Between schedule() and update() the caller may abort or finish requests; their outputs in
the result are then ignored. A plan never names one seq_id both in finished_seq_ids and in
new, so the executor may apply the two lists in either order.

Overlapped scheduling (``SchedulerLimits.overlap_scheduling``): the caller may plan step
N+1 while step N is in flight, and update() them in order, so the executor never waits for
the scheduler:

    plan_n = scheduler.schedule();  send(plan_n)
    plan_n1 = scheduler.schedule(); send(plan_n1)      # step N still running
    scheduler.update(plan_n, receive())                # while step N+1 runs
    plan_n2 = scheduler.schedule(); send(plan_n2)
    scheduler.update(plan_n1, receive()) ...

At most two steps are in flight, updated in the order they were scheduled. A running
request whose step N samples a token is scheduled in step N+1 for that token before the
scheduler knows it (a placeholder: ``Request.num_output_placeholders``): the executor runs
steps in order and appends what it samples, so it holds the token when step N+1 starts.
Stops (EOS, stop ids, stop strings) are therefore seen one step late; the surplus token of
step N+1 is dropped (never reported, never counted) and the executor forgets the sequence
in the next plan's finished_seq_ids. Steps that would pass max_tokens or max_model_len are
never planned: a request whose in-flight token is its last waits for its update instead.
Draft tokens go only to a request with nothing in flight, and a request verifying drafts is
not scheduled again before that step's update (where its next step starts depends on how
many drafts the executor accepts). So a speculative step is never overlapped: the engine
core keeps one step in flight while any request drafts (services/scheduler/engine/).

Blocks for drafts: the plan allocates blocks for all 1 + k positions. After the update only
the accepted ones count as computed (``num_computed_tokens = num_tokens - 1``); the rejected
positions' slots are simply overwritten by later steps, and blocks wholly past the accepted
tokens stay in the request's table, to be filled by its next tokens (at most
ceil(k / block_size) blocks per request, freed with the rest at finish or preemption; the
KV-waste gauge counts them as allocated but unused slots).

Multi-step scheduling (``SchedulerLimits.num_scheduler_steps`` = n > 1): while no request
waits, a plain decode is planned as n decode steps run back to back by the executor
(``RunningSequence.num_steps``): the plan covers n positions with blocks, the request gets n
placeholders, and the output brings n tokens, appended one by one with every stop checked, so
a stop inside the burst cuts the rest (dropped, never reported, like overlap's surplus token).
A burst never passes max_tokens or max_model_len. It composes with overlap: the next plan
continues from the burst's last sampled token as from any placeholder. A request whose first
token is still in flight (the decode planned behind its prefill) runs one step: its time to
first token is not made to share the cores with a burst it does not need yet.

Invariants with two steps in flight (what makes them safe):
- Confirmed state: ``num_computed_tokens`` and the known tokens only change in update(), in
  step order, so update(N) sees each request as if step N were the only step in flight.
  Planning uses ``num_planned_tokens`` (computed + in flight), and blocks are allocated to
  cover it, so a block table always covers every position a step in flight writes.
- Prefix caching registers a block only once all its tokens are confirmed computed (hence
  known); a step in flight writes only at positions at or beyond its request's confirmed
  ``num_computed_tokens``, so never into a cached block.
- Freeing at finish, abort and preemption stays immediate. A freed block may still be
  written by a step in flight (the surplus step of a finished request, the step of a
  preempted or aborted one), but it can only be handed out again by a plan scheduled after
  the free, which the executor runs after every step in flight at the time of the free
  (steps run in order: one stream, one worker). The new owner reads only slots it writes
  itself in that later step or after, or cached blocks, which no step in flight writes. So
  no step ever reads a slot clobbered by another sequence's late write. This relies on the
  executor running plans strictly in step order.
- A request preempted while its step is in flight restarts from its known tokens; that
  step's output is ignored (the token is sampled again, identically for greedy and seeded
  sampling). Each in-flight record remembers the request's preemption count to tell.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from services.common.step import RunningSequence, StepPlan, StepResult, TokenLogprobs
from services.scheduler.core import step_size
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.burst import BurstLength
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.in_flight import StepInFlight, checked_in_flight, mark_in_flight
from services.scheduler.core.model_fit import check_fits_model
from services.scheduler.core.preemption import Preemption
from services.scheduler.core.sampled_tokens import append_sampled
from services.scheduler.core.speculation import SpecDecodeStats
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.core.waiting_queue import QueueFullError, WaitingQueue
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request, RequestStatus
from services.scheduler.request.update import RequestUpdate


class Scheduler:
    def __init__(self, config: SchedulerConfig, seq_ids: Iterator[int] | None = None) -> None:
        """``seq_ids``: where sequence ids come from; an engine with several executors shares
        one counter between their schedulers, so an id names one sequence across all of them
        (the drafter and the text streams see them all)."""
        config.validate()
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.limits.enable_prefix_caching, config.kv_group_windows
        )
        self.waiting = WaitingQueue(idle_credit=config.max_model_len)
        """By priority, then the tenant served the fewest tokens, then arrival (core/waiting_queue.py)."""
        self.running: list[Request] = []
        """Requests known to the executor, sorted by Request.sort_key (most urgent first)."""
        self.requests: dict[str, Request] = {}
        """Every unfinished request by request_id."""
        self.preemption = Preemption(self.running, self.waiting, self.block_manager, config)
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count()
        self._next_step_id = 0
        self._finished_seq_ids: list[int] = []
        self._failed: list[tuple[str, str]] = []
        """Sequences the executor must forget, reported in the next plan."""
        self._in_flight: deque[StepInFlight] = deque()
        """Plans that scheduled a sequence and await update(), oldest first."""
        self._max_steps_in_flight = 2 if config.limits.overlap_scheduling else 1
        self.spec_stats = SpecDecodeStats()
        limits = config.limits
        self.burst = BurstLength(limits.num_scheduler_steps, limits.multi_step_max_delay_ms / 1000)
        """Decode steps per burst while nobody waits (core/burst.py)."""

    @property
    def num_preemptions(self) -> int:
        return self.preemption.count

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request, moved: bool = False) -> None:
        """Validate, assign a seq_id and queue the request.

        Raises ValueError (naming the field and the limit) for a request that can never be
        served, QueueFullError when max_waiting_requests are already waiting.

        ``moved``: the request comes from another executor's scheduler (Request.leave_executor):
        it keeps its outputs and restarts here from its known tokens, or from the KV blocks it
        already holds in this pool (``block_ids`` covering ``num_computed_tokens``: its prompt
        was computed elsewhere and copied here). A moved request is never refused for a full
        queue: it was admitted once already.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if moved != (request.status is RequestStatus.PREEMPTED) or request.seq_id != -1:
            raise ValueError(f"request {request.request_id!r} was already added to a scheduler")
        check_fits_model(request, self.config.max_model_len, self.config.vocab_size)
        max_waiting = self.config.limits.max_waiting_requests
        if not moved and len(self.waiting) >= max_waiting:
            raise QueueFullError(
                f"waiting queue is full: {len(self.waiting)} requests waiting, "
                f"max_waiting_requests={max_waiting}"
            )
        request.seq_id = next(self._seq_ids)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def detach_request(self, request_id: str) -> list[int]:
        """Hand a running request over to another executor: it leaves this scheduler (the
        executor forgets it in the next plan) and its blocks stay held, returned, until
        ``block_manager.pool.release``: its KV is being copied from them."""
        request = self.requests.pop(request_id)
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running here (status {request.status.name})")
        self.running.remove(request)
        self._finished_seq_ids.append(request.seq_id)
        block_ids = self.block_manager.detach(request)
        request.leave_executor()
        return block_ids

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the requests whose last updated step failed them in the
        executor (a grammar matcher at a limit): the caller ends each with FinishReason.ERROR
        and the error (finish_request frees its blocks). Taken once."""
        failed, self._failed = self._failed, []
        return failed

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> bool:
        """End a request from outside (stop string found after detokenization, abort, error).

        Its blocks are freed at once; if the executor knows it, its seq_id goes into the next
        plan's finished_seq_ids. Returns False when no unfinished request has this id.
        """
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, stop_reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_steps_in_flight(self) -> int:
        """Plans that scheduled a sequence and whose update() has not come yet."""
        return len(self._in_flight)

    def get_stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=manager.pool.usage,
            num_free_blocks=manager.pool.num_free,
            num_blocks=manager.num_blocks,
            prefix_cache_queries=manager.prefixes.queries,
            prefix_cache_hits=manager.prefixes.hits,
            spec_decode=SpecDecodeStats(
                *(getattr(self.spec_stats, name) for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")),
                list(self.spec_stats.accepted_per_position), list(self.spec_stats.drafted_per_position),
            ),
        )

    def requests_ready_to_draft(self) -> list[Request]:
        """Running requests that could verify drafts in the next plan: they speculate, their
        known tokens are all computed but the last (a decode) and nothing of theirs is in
        flight (drafts continue the last known token; see the module docstring)."""
        return [
            request for request in self.running
            if request.draft_length is not None
            and not request.num_in_flight_tokens
            and request.num_computed_tokens == request.num_tokens - 1
        ]

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step. ``now`` (caller's clock) stamps first_scheduled_time.

        Running requests go first, most urgent first (decodes and continuing prefill chunks);
        a running request that cannot get a block preempts the least urgent running request
        (possibly itself). Then, unless that happened, waiting requests start in
        (priority, arrival) order until the token budget, max_num_seqs or the blocks run out.

        With overlap_scheduling, may be called once more before the previous plan's update():
        running requests then continue from their planned tokens (see the module docstring).
        """
        if len(self._in_flight) >= self._max_steps_in_flight:
            raise RuntimeError(
                f"step {self._in_flight[-1].step_id} was scheduled but update() was not called "
                f"({len(self._in_flight)} step(s) in flight, overlap_scheduling="
                f"{self.config.limits.overlap_scheduling})"
            )
        plan = StepPlan(step_id=self._next_step_id, finished_seq_ids=self._finished_seq_ids)
        self._next_step_id += 1
        self._finished_seq_ids = []
        step = StepInFlight(plan.step_id)
        budget = self.config.limits.max_num_batched_tokens
        self.waiting.set_running({request.tenant for request in self.running})
        self.preemption.for_waiting_head(plan)
        # Preempting for the waiting head made room for it: it starts in this step (waiting a
        # step here was most of a quiet tenant's extra TTFT under a flood). Only running out
        # of blocks below holds new work back.
        victims = set(plan.finished_seq_ids)
        preemptions_before = self.num_preemptions

        budget = self._schedule_running(plan, step, budget)

        # Starting new work in a step that had to preempt would only preempt again next step;
        # it also keeps a victim out of `new` in the very plan that tells the executor to forget it.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(plan, step, budget, now, victims)

        if step.scheduled:
            self._in_flight.append(step)
        return plan

    def _schedule_running(self, plan: StepPlan, step: StepInFlight, budget: int) -> int:
        """Plan the running requests, most urgent first; returns the token budget left."""
        limits, max_model_len = self.config.limits, self.config.max_model_len
        # Multi-step only while nobody waits: a burst would hold a new request back that long.
        max_steps = self.burst.steps if not len(self.waiting) else 1
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.drafts_in_flight or step_size.last_token_in_flight(request, max_model_len):
                index += 1  # nothing to plan until its step in flight is updated
                continue
            num_new, draft_token_ids = step_size.running_tokens(request, budget, limits, max_model_len)
            num_steps = (step_size.decode_steps(request, num_new, draft_token_ids, max_steps, max_model_len)
                         if max_steps > 1 else 1)
            new_block_ids = self.preemption.allocate_or_preempt(request, num_new + num_steps - 1, plan)
            if new_block_ids is None:
                break  # the request preempted itself: nobody less urgent was left
            request.spec_token_ids = []
            plan.running.append(
                RunningSequence(request.seq_id, num_new, new_block_ids, draft_token_ids, num_steps)
            )
            mark_in_flight(step, request, num_new, draft_token_ids, num_steps)
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, step: StepInFlight, budget: int, now: float | None,
                          victims: set[int] = frozenset()) -> None:
        limits = self.config.limits
        manager = self.block_manager
        adapters = {r.adapter for r in self.running if r.adapter}
        while budget > 0 and len(self.running) < limits.max_num_seqs:
            request = self.waiting.peek()
            if request is None or request.seq_id in victims:
                break  # a request preempted in this plan cannot also start in it
            if request.adapter and request.adapter not in adapters and len(adapters) >= self.config.max_loras:
                break  # every adapter slot is taken by running requests; keep arrival order
            if request.block_ids:  # its KV was copied here from the executor that computed it
                hit_block_ids, num_hit_tokens = [], request.num_computed_tokens
            else:
                hit_block_ids, num_hit_tokens = manager.prefixes.get_computed_blocks(request)
            num_new = step_size.starting_tokens(request.num_tokens - num_hit_tokens, budget, limits)
            if num_new is None:
                break  # wait for a step with room for the whole prompt; keep arrival order
            new_block_ids = manager.allocate_slots(request, num_new, hit_block_ids)
            if new_block_ids is None:
                break  # out of blocks: later requests must not overtake this one
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:  # first start, not a resumption
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = now
                self.waiting.charge(request.tenant, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            bisect.insort(self.running, request, key=_sort_key)
            plan.new.append(step_size.new_sequence(request, num_new))
            if request.adapter:
                adapters.add(request.adapter)
            mark_in_flight(step, request, num_new)
            budget -= num_new

    # ---- update ------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply the executor's output of ``plan``; return one update per request that got
        tokens this step (finished ones included, their blocks already freed).

        ``result`` must hold exactly one output per scheduled request that is still
        unfinished; outputs of requests finished (or preempted) since schedule() are optional
        and ignored. With two plans in flight, update them in the order they were scheduled.
        After an executor failure: finish the in-flight requests with ERROR, then call
        update(plan, StepResult(plan.step_id)) for each plan in flight.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result.step_id={result.step_id} does not match plan.step_id={plan.step_id}")
        if plan.is_empty:
            if result.outputs:
                raise ValueError(f"step {plan.step_id} scheduled no sequence but the result has outputs")
            return []
        in_flight = checked_in_flight(self._in_flight, plan, result)
        self._in_flight.popleft()
        if not plan.new and all(seq.num_scheduled_tokens == 1 for seq in plan.running):
            self.burst.observe(result.execute_seconds, max(seq.num_steps for seq in plan.running))
        for scheduled in in_flight.values():
            if scheduled.is_current:
                request = scheduled.request
                request.num_in_flight_tokens -= scheduled.num_positions
                request.num_output_placeholders -= scheduled.samples * scheduled.num_steps
                request.drafts_in_flight = False
        updates = []
        for output in result.outputs:
            scheduled = in_flight[output.seq_id]
            if not scheduled.is_current:
                # Aborted or finished by the caller after schedule(), finished by a stop in the
                # previous step's update (a surplus token), or preempted since: ignored.
                continue
            request = scheduled.request
            if output.error is not None:  # it cannot go on: ended by the caller (take_failed)
                self._failed.append((request.request_id, output.error))
                continue
            if output.prompt_logprobs:
                request.add_prompt_logprobs(request.num_computed_tokens, output.prompt_logprobs)
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            if not output.token_ids:  # a prefill chunk short of the end: nothing to report
                self.block_manager.computed(request)
                continue
            first = request.num_output_tokens == 0
            update = append_sampled(request, output.token_ids, output.logprobs, self.config.max_model_len)
            if first and request.sampling.prompt_logprobs is not None:
                update.prompt_logprobs = [(request.prompt_token_ids[0], TokenLogprobs(0.0)),
                                          *zip(request.prompt_token_ids[1:], request.prompt_logprobs)]
            self.waiting.charge(request.tenant, len(update.new_token_ids))
            if scheduled.draft_token_ids:
                self._count_accepted_drafts(request, len(scheduled.draft_token_ids), len(output.token_ids) - 1,
                                            len(update.new_token_ids))
            # The last sampled token has no K/V yet; with speculation, neither do the rejected
            # drafts beyond the accepted ones.
            request.num_computed_tokens = request.num_tokens - 1
            self.block_manager.computed(request)
            if update.finish_reason is not None:
                self._finish(request, update.finish_reason, update.stop_reason)
            updates.append(update)
        return updates

    def _count_accepted_drafts(self, request: Request, num_drafts: int, num_accepted: int, num_new: int) -> None:
        """Speculation's statistics after a step that verified ``num_drafts`` drafts of ``request``
        (``num_new``: the tokens it kept, fewer than accepted where a stop cut them)."""
        self.spec_stats.record(num_drafts, num_accepted)
        if request.draft_length is not None:
            request.draft_length.observe(num_drafts, num_accepted)
        request.num_accepted_draft_tokens += min(num_accepted, num_new)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._finished_seq_ids.append(request.seq_id)
        else:  # WAITING or PREEMPTED: the executor does not hold it
            self.waiting.remove(request)
        request.status = RequestStatus.for_finish_reason(reason)
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.spec_token_ids = []
        request.forget_in_flight()
        self.block_manager.free(request)
        del self.requests[request.request_id]


def _sort_key(request: Request) -> tuple[int, float, int]:
    return request.sort_key
