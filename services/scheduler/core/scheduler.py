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
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from services.common.step import NewSequence, RunningSequence, SequenceOutput, StepPlan, StepResult
from services.scheduler.core.block_manager import BlockManager
from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.outputs import RequestUpdate, SchedulerStats
from services.scheduler.core.request import FinishReason, Request, RequestStatus
from services.scheduler.core.waiting_queue import QueueFullError, WaitingQueue


@dataclass(slots=True)
class _Scheduled:
    """What the in-flight plan asked of one request, kept until update()."""

    request: Request
    num_scheduled_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.limits.enable_prefix_caching
        )
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        """Requests known to the executor, sorted by Request.sort_key (most urgent first)."""
        self.requests: dict[str, Request] = {}
        """Every unfinished request by request_id."""
        self.num_preemptions = 0
        self._next_seq_id = 0
        self._next_step_id = 0
        self._finished_seq_ids: list[int] = []
        """Sequences the executor must forget, reported in the next plan."""
        self._in_flight: dict[int, _Scheduled] = {}
        self._in_flight_step_id = -1

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate, assign a seq_id and queue the request.

        Raises ValueError (naming the field and the limit) for a request that can never be
        served, QueueFullError when max_waiting_requests are already waiting.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.seq_id != -1 or request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} was already added to a scheduler")
        request.validate(self.config.max_model_len, self.config.vocab_size)
        max_waiting = self.config.limits.max_waiting_requests
        if len(self.waiting) >= max_waiting:
            raise QueueFullError(
                f"waiting queue is full: {len(self.waiting)} requests waiting, "
                f"max_waiting_requests={max_waiting}"
            )
        request.seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort an unfinished request; False when none has this id. Frees its blocks now."""
        return self.finish_request(request_id, FinishReason.ABORT)

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

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_blocks=manager.num_blocks,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
        )

    # ---- schedule ----------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step. ``now`` (caller's clock) stamps first_scheduled_time.

        Running requests go first, most urgent first (decodes and continuing prefill chunks);
        a running request that cannot get a block preempts the least urgent running request
        (possibly itself). Then, if nothing was preempted, waiting requests start in
        (priority, arrival) order until the token budget, max_num_seqs or the blocks run out.
        """
        if self._in_flight:
            raise RuntimeError(
                f"step {self._in_flight_step_id} was scheduled but update() was not called"
            )
        plan = StepPlan(step_id=self._next_step_id, finished_seq_ids=self._finished_seq_ids)
        self._next_step_id += 1
        self._finished_seq_ids = []
        budget = self.config.limits.max_num_batched_tokens
        preemptions_before = self.num_preemptions

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new, draft_token_ids = self._running_tokens_to_schedule(request, budget)
            new_block_ids = self._allocate_or_preempt(request, num_new, plan)
            if new_block_ids is None:
                break  # the request preempted itself: nobody less urgent was left
            request.spec_token_ids = []
            plan.running.append(
                RunningSequence(request.seq_id, num_new, new_block_ids, draft_token_ids)
            )
            self._in_flight[request.seq_id] = _Scheduled(request, num_new, draft_token_ids)
            budget -= num_new
            index += 1

        # Starting new work in a step that had to preempt would only preempt again next step;
        # it also keeps a victim out of `new` in the very plan that tells the executor to forget it.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(plan, budget, now)

        if self._in_flight:
            self._in_flight_step_id = plan.step_id
        return plan

    def _running_tokens_to_schedule(self, request: Request, budget: int) -> tuple[int, list[int]]:
        num_new = request.num_tokens - request.num_computed_tokens
        threshold = self.config.limits.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        draft_token_ids: list[int] = []
        if num_new == 1 and request.spec_token_ids:
            # k drafts + 1 bonus token may all be accepted: keep the total within both limits.
            room = self.config.max_model_len - request.num_tokens
            if request.stop.max_tokens is not None:
                room = min(room, request.stop.max_tokens - request.num_output_tokens)
            draft_token_ids = request.spec_token_ids[: max(0, min(room - 1, budget - 1))]
            num_new += len(draft_token_ids)
        return min(num_new, budget), draft_token_ids

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> list[int] | None:
        while True:
            new_block_ids = self.block_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            # self.running is sorted most urgent first, and requests before `request` were
            # already scheduled this step, so the victim is the last one (maybe `request`).
            victim = self.running.pop()
            self._preempt(victim)
            plan.finished_seq_ids.append(victim.seq_id)
            if victim is request:
                return None

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float | None) -> None:
        limits = self.config.limits
        manager = self.block_manager
        while budget > 0 and len(self.running) < limits.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            hit_block_ids, num_hit_tokens = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if limits.long_prefill_token_threshold > 0:
                num_new = min(num_new, limits.long_prefill_token_threshold)
            if num_new > budget:
                if not limits.enable_chunked_prefill:
                    break  # wait for a step with room for the whole prompt; keep arrival order
                num_new = budget
            new_block_ids = manager.allocate_slots(request, num_new, hit_block_ids)
            if new_block_ids is None:
                break  # out of blocks: later requests must not overtake this one
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:  # first start, not a resumption
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            bisect.insort(self.running, request, key=_sort_key)
            plan.new.append(
                NewSequence(
                    seq_id=request.seq_id,
                    token_ids=list(request.all_token_ids),
                    prompt_len=request.num_prompt_tokens,
                    num_computed_tokens=num_hit_tokens,
                    num_scheduled_tokens=num_new,
                    block_ids=list(request.block_ids),
                    sampling=request.sampling,
                    min_tokens_ban=request.min_tokens_ban,
                )
            )
            self._in_flight[request.seq_id] = _Scheduled(request, num_new)
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Recompute-mode preemption: drop its blocks; it restarts from its known tokens.

        Its full blocks keep their prefix-cache hashes, so unless evicted meanwhile the restart
        is mostly prefix hits.
        """
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    # ---- update ------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Apply the executor's output of ``plan``; return one update per request that got
        tokens this step (finished ones included, their blocks already freed).

        ``result`` must hold exactly one output per scheduled request that is still
        unfinished; outputs of requests finished since schedule() are optional and ignored.
        After an executor failure: finish the in-flight requests with ERROR, then call
        update(plan, StepResult(plan.step_id)).
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result.step_id={result.step_id} does not match plan.step_id={plan.step_id}")
        if not self._in_flight:
            if result.outputs:
                raise ValueError(f"step {plan.step_id} scheduled no sequence but the result has outputs")
            return []
        if plan.step_id != self._in_flight_step_id:
            raise ValueError(
                f"plan.step_id={plan.step_id} is not the step in flight ({self._in_flight_step_id})"
            )
        output_seq_ids = [output.seq_id for output in result.outputs]
        if len(set(output_seq_ids)) != len(output_seq_ids):
            raise ValueError(f"step {plan.step_id}: duplicate seq ids in outputs {output_seq_ids}")
        for output in result.outputs:
            self._check_output(output)
        answered = set(output_seq_ids)
        missing = [
            seq_id
            for seq_id, scheduled in self._in_flight.items()
            if not scheduled.request.is_finished and seq_id not in answered
        ]
        if missing:
            raise ValueError(f"step {plan.step_id}: no output for scheduled seq ids {missing}")

        in_flight, self._in_flight = self._in_flight, {}
        updates = []
        for output in result.outputs:
            scheduled = in_flight[output.seq_id]
            request = scheduled.request
            if request.is_finished:
                continue  # aborted or finished by the caller after schedule()
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            if not output.token_ids:  # a prefill chunk short of the end: nothing to report
                self.block_manager.cache_full_blocks(request)
                continue
            update = self._append_outputs(request, output)
            # The last sampled token has no K/V yet; with speculation, neither do the rejected
            # drafts beyond the accepted ones.
            request.num_computed_tokens = request.num_tokens - 1
            self.block_manager.cache_full_blocks(request)
            if update.finish_reason is not None:
                self._finish(request, update.finish_reason, update.stop_reason)
            updates.append(update)
        return updates

    def _check_output(self, output: SequenceOutput) -> None:
        scheduled = self._in_flight.get(output.seq_id)
        if scheduled is None:
            raise ValueError(f"output for seq id {output.seq_id}, which was not scheduled in this step")
        request = scheduled.request
        if request.is_finished:
            return
        num_tokens = len(output.token_ids)
        reaches_end = (
            request.num_computed_tokens + scheduled.num_scheduled_tokens >= request.num_tokens
        )
        drafts = scheduled.draft_token_ids
        if not reaches_end and num_tokens:
            raise ValueError(
                f"seq id {output.seq_id}: {num_tokens} tokens for a prefill chunk that does not "
                f"reach the end of its {request.num_tokens} tokens"
            )
        if reaches_end and not (1 <= num_tokens <= 1 + len(drafts)):
            raise ValueError(
                f"seq id {output.seq_id}: {num_tokens} output tokens, expected 1 to "
                f"{1 + len(drafts)} (1 + {len(drafts)} drafts)"
            )
        if num_tokens > 1 and output.token_ids[:-1] != drafts[: num_tokens - 1]:
            raise ValueError(
                f"seq id {output.seq_id}: accepted tokens {output.token_ids[:-1]} are not a "
                f"prefix of the drafts {drafts}"
            )
        if output.logprobs is not None and len(output.logprobs) != num_tokens:
            raise ValueError(
                f"seq id {output.seq_id}: {len(output.logprobs)} logprobs for {num_tokens} tokens"
            )

    def _append_outputs(self, request: Request, output: SequenceOutput) -> RequestUpdate:
        """Append tokens one by one, checking stops after each; cut the rest after a stop.

        Per token, in order: stop_token_ids (STOP) and EOS (EOS, unless ignore_eos) — both only
        when at least min_tokens tokens came before it —, then max_tokens (LENGTH), then
        max_model_len (LENGTH).
        """
        stop = request.stop
        eos_token_ids = request.eos_token_ids
        max_model_len = self.config.max_model_len
        logprobs = output.logprobs
        reason: FinishReason | None = None
        stop_reason: int | None = None
        num_appended = 0
        for token_id in output.token_ids:
            request.append_output_token(
                token_id, logprobs[num_appended] if logprobs is not None else None
            )
            num_appended += 1
            num_output = request.num_output_tokens
            if num_output > stop.min_tokens:
                if token_id in stop.stop_token_ids:
                    reason, stop_reason = FinishReason.STOP, token_id
                elif not stop.ignore_eos and token_id in eos_token_ids:
                    reason = FinishReason.EOS
            if reason is None and stop.max_tokens is not None and num_output >= stop.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None and request.num_tokens >= max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        return RequestUpdate(
            request_id=request.request_id,
            seq_id=request.seq_id,
            new_token_ids=list(output.token_ids[:num_appended]),
            new_logprobs=list(logprobs[:num_appended]) if logprobs is not None else None,
            finish_reason=reason,
            stop_reason=stop_reason,
        )

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
        self.block_manager.free(request)
        del self.requests[request.request_id]


def _sort_key(request: Request) -> tuple[int, float, int]:
    return request.sort_key
