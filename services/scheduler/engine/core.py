"""The engine core: one loop for the services and the in-process engine.

    schedule → send (executor port) → receive → update → publish (detokenizer ports → deltas)

Transport-free: the executor, the detokenizers and the drafter are ports (ports.py). The
scheduler service drives it with gRPC links (services/scheduler/supervisor.py), the
in-process engine with local objects (services/inprocess/), both through ``step`` (one
round) or ``run`` (rounds until cancelled), so "services vs in-process" compares the same
loop over two transports.

With overlapped scheduling (``SchedulerLimits.overlap_scheduling``, on by default) the loop
keeps two steps in flight: it sends step N+1 before it reads step N's result, so the
executor starts N+1 as soon as N is done, while the result travels back and the loop
updates the scheduler core and plans N+2:

    schedule N, send N; schedule N+1, send N+1
    round: receive N → update N → publish N → schedule N+2, send N+2 → receive N+1 → ...

Stops are then seen a step late (the scheduler core drops the surplus token). Off, it is one
step at a time. Speculation (drafting.py) keeps one step in flight while drafts pay.

Everything the core holds of an executor lives in one ``ExecutorLane`` (its port, its
scheduler core with its block manager and prefix cache, its steps in flight), so more than
one executor behind one engine is more lanes, not another loop. When an executor port fails,
every request on its lane ends with one final Finished (reason error, the cause in
error_message: a client that saw partial output must not see a bare error, or a retry would
duplicate text), the lane is dropped, and ``on_executor_lost`` tells the owner, which
reconnects and ``attach``es again.

Request handlers call ``submit``/``abort`` on the same event loop (no locks); each request's
deltas go to its sink.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from services.common.errors import ResourceExhaustedError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo, StepPlan
from services.scheduler.core.config import SchedulerConfig, SchedulerLimits
from services.scheduler.core.kv_slots import KVSlotUsage, kv_slot_usage
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.core.waiting_queue import QueueFullError
from services.scheduler.engine.drafting import Drafting
from services.scheduler.engine.ports import EXECUTOR_LOST, DetokenizerPort, DrafterPort, ExecutorPort
from services.scheduler.engine.publisher import Publisher
from services.scheduler.engine.step_times import StepTimeTotals
from services.scheduler.engine.request_table import FinishedObserver, RequestTable
from services.scheduler.engine.tracked import DeltaSink
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.output import RequestOutput
from services.scheduler.request.request import Request
from services.scheduler.request.stop import StopConditions

_log = structlog.get_logger("tokenmill.scheduler")

EXECUTOR_UNAVAILABLE = "the executor is unavailable (restarting or unreachable); retry shortly"
"""What a request hears while no executor is attached. No address: the door sends it before
authentication, to any caller."""

@dataclass(slots=True)
class _Sent:
    """A step sent to the executor whose result the loop has not read yet."""

    plan: StepPlan
    schedule_s: float
    send_s: float


@dataclass(slots=True)
class ExecutorLane:
    """One executor as the engine sees it: its port and the scheduler core of its memory."""

    port: ExecutorPort
    scheduler: Scheduler
    info: ExecutorInfo
    sent: deque[_Sent] = field(default_factory=deque)
    """Steps sent and not yet read, oldest first: one, or two with overlapped scheduling."""


def model_eos_token_ids(tokenizer_eos_token_ids: Sequence[int], info: ExecutorInfo) -> tuple[int, ...]:
    """The EOS ids every request stops at: the tokenizer's when it names any, else the
    model config's (as the executor reports them)."""
    return tuple(tokenizer_eos_token_ids) or tuple(info.eos_token_ids)


class EngineCore:
    def __init__(self, limits: SchedulerLimits, detokenizers: Sequence[DetokenizerPort], *,
                 drafter: DrafterPort | None = None, speculation: SpeculationConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, on_finished: FinishedObserver | None = None,
                 on_executor_lost: Callable[[str], None] | None = None) -> None:
        if not detokenizers:
            raise ValueError("an engine needs at least one detokenizer")
        self.limits = limits
        self.detokenizers = list(detokenizers)
        self.clock = clock
        self.drafting = Drafting(drafter, speculation or SpeculationConfig()) if drafter is not None else None
        self._on_executor_lost = on_executor_lost or (lambda error: None)
        self.lane: ExecutorLane | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self._wake = asyncio.Event()
        self.requests = RequestTable(self.detokenizers, clock, self._finish_in_core, on_finished, self._wake.set)
        self.step_times = StepTimeTotals()
        self.step_count = 0
        self.last_step_time = 0.0
        self.publisher = Publisher(self.requests, self.detokenizers, clock, self.step_times)

    # ------------------------------------------------------------------ executors
    def attach(self, port: ExecutorPort, info: ExecutorInfo, tokenizer_eos_token_ids: Sequence[int] = ()) -> None:
        """Serve on this executor: a scheduler core for its memory (SchedulerConfig.for_executor
        raises ValueError naming the limit its facts break)."""
        scheduler = Scheduler(SchedulerConfig.for_executor(self.limits, info))
        if self.drafting is not None:
            self.drafting.forget_all()  # seq ids start over with the new core
        self.eos_token_ids = model_eos_token_ids(tokenizer_eos_token_ids, info)
        self.lane = ExecutorLane(port, scheduler, info)
        self._wake.set()

    def wake(self) -> None:
        """Make an idle loop look again (a port changed state)."""
        self._wake.set()

    @property
    def scheduler(self) -> Scheduler | None:
        return self.lane.scheduler if self.lane is not None else None

    # ------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, stop: StopConditions,
               sink: DeltaSink, priority: int = 0, num_speculative_tokens: int | None = None,
               tenant: str = "") -> RequestOutput:
        """Admit a request; its deltas go to ``sink``, the last one finished.

        Raises UnavailableError while no executor (or no detokenizer) is attached,
        InvalidArgumentError for a request_id in use, ValueError (naming the field) for a
        request the scheduler core refuses, ResourceExhaustedError when the waiting queue is
        full. ``tenant`` ("" without authentication) is whom admission is fair between.
        """
        lane = self.lane
        if lane is None:
            raise UnavailableError(EXECUTOR_UNAVAILABLE)
        detokenizer = self.requests.check_new(request_id)
        now = self.clock()
        request = Request(request_id, prompt_ids, sampling, stop, self.eos_token_ids, priority=priority,
                          arrival_time=now, tenant=tenant)
        try:
            lane.scheduler.add_request(request)
        except QueueFullError as exc:
            raise ResourceExhaustedError(str(exc)) from None
        if self.drafting is not None:
            request.draft_length = self.drafting.draft_length(num_speculative_tokens)
        output = RequestOutput(request, now)
        self.requests.add(output, sink, detokenizer)
        self._wake.set()
        return output

    def abort(self, request_id: str) -> GenerationDelta | None:
        """End a request from outside (client cancelled, Abort RPC); its blocks are freed now.
        Returns its final delta (also sent to its sink), None for an unknown id."""
        tracked = self.requests.get(request_id)
        return self.requests.end(tracked, FinishReason.ABORT) if tracked is not None else None

    def has_unfinished(self) -> bool:
        return len(self.requests) > 0

    def stats(self) -> SchedulerStats | None:
        return self.lane.scheduler.get_stats() if self.lane is not None else None

    def kv_slots(self) -> KVSlotUsage | None:
        lane = self.lane
        return kv_slot_usage(lane.scheduler.running, lane.scheduler.config.block_size) if lane is not None else None

    def _finish_in_core(self, request_id: str, reason: FinishReason, stop_string: str | None) -> None:
        if self.lane is not None:
            self.lane.scheduler.finish_request(request_id, reason, stop_string)

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Rounds until cancelled; idle while there is nothing to plan."""
        while True:
            if await self.step():
                await asyncio.sleep(0)  # let request handlers and the output stage run between steps
            else:
                self._wake.clear()
                await self._wake.wait()

    async def step(self) -> bool:
        """One round: plan and send until the pipeline is full (overlap depth) or nothing is
        left to plan, then receive the oldest step, update the scheduler core and queue its
        updates for the output stage. False when there was nothing to do."""
        lane = self.lane
        if lane is None:
            return False
        if not lane.port.connected:
            # The executor went away between steps: handle it as a failed step now, not when
            # the next request is sent into it.
            self._lost(lane, "the executor ended the step stream")
            return True
        await self._fill(lane)
        if self.lane is not lane:
            return True
        if not lane.sent:
            closed = self.requests.take_pending_close()
            if closed:
                self.publisher.put([], closed)
            return False
        await self._receive(lane)
        return True

    async def _fill(self, lane: ExecutorLane) -> None:
        overlap_depth = 2 if self.limits.overlap_scheduling else 1
        depth = 1 if self.drafting is not None and self.drafting.speculating(lane.scheduler) else overlap_depth
        totals = self.step_times
        while len(lane.sent) < depth:
            started = time.perf_counter()
            if not lane.sent and self.drafting is not None:
                await self.drafting.draft(lane.scheduler)
                if self.lane is not lane:
                    return
            plan = lane.scheduler.schedule(self.clock())
            if plan.is_empty and not plan.finished_seq_ids:
                return
            scheduled = time.perf_counter()
            try:
                await lane.port.send(plan)
            except EXECUTOR_LOST as exc:
                _log.error("executor_step_failed", error=str(exc), step_id=plan.step_id)
                self._lost(lane, str(exc))
                return
            if lane.sent:
                totals.overlapped += 1
            lane.sent.append(_Sent(plan, scheduled - started, time.perf_counter() - scheduled))

    async def _receive(self, lane: ExecutorLane) -> None:
        sent = lane.sent.popleft()
        plan = sent.plan
        waited = time.perf_counter()
        try:
            result = await lane.port.receive(plan.step_id)
        except EXECUTOR_LOST as exc:
            _log.error("executor_step_failed", error=str(exc), step_id=plan.step_id)
            self._lost(lane, str(exc))
            return
        if self.lane is not lane:
            return
        stepped = time.perf_counter()
        try:
            updates = lane.scheduler.update(plan, result)
        except ValueError as exc:  # the executor broke the step contract: it cannot be trusted
            _log.error("executor_result_invalid", error=str(exc), step_id=plan.step_id)
            self._lost(lane, f"the executor sent an invalid result for step {plan.step_id}: {exc}")
            return
        self.step_count += 1
        self.last_step_time = self.clock()
        totals = self.step_times
        totals.steps += 1
        totals.sequences += len(plan.new) + len(plan.running)
        totals.schedule_s += sent.schedule_s
        totals.executor_s += sent.send_s + stepped - waited
        totals.execute_s += result.execute_seconds
        totals.update_s += time.perf_counter() - stepped
        closed = self.requests.take_pending_close()
        for update in updates:
            tracked = self.requests.get(update.request_id)
            if update.finish_reason is not None and tracked is not None:
                closed.append((update.seq_id, tracked.detokenizer))
        self.publisher.put(updates, closed)

    def _lost(self, lane: ExecutorLane, error: str) -> None:
        """End every request with Finished (error) and drop the lane (its scheduler core
        described the lost executor's memory); the owner reconnects."""
        self.requests.end_all(error)
        closed = self.requests.take_pending_close()
        if closed:  # the detokenizers outlive the executor: close the streams now
            self.publisher.put([], closed)
        if self.lane is lane:
            self.lane = None
        self._on_executor_lost(error)
