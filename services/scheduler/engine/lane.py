"""One executor as the engine sees it, and the loop that drives it.

    schedule → send (executor port) → receive → update → queue the updates for the output stage

Every lane runs its own rounds (its own task in the services), so executors never wait for
each other: a slow executor delays only the requests placed on it. The output stage, the
request table, the drafter and the step totals are shared (``LaneContext``).

With overlapped scheduling (``SchedulerLimits.overlap_scheduling``, on by default) a lane
keeps two steps in flight: it sends step N+1 before it reads step N's result, so the executor
starts N+1 as soon as N is done, while the result travels back and the lane updates its
scheduler core and plans N+2:

    schedule N, send N; schedule N+1, send N+1
    round: receive N → update N → publish N → schedule N+2, send N+2 → receive N+1 → ...

Stops are then seen a step late (the scheduler core drops the surplus token). Off, it is one
step at a time. Speculation (drafting.py) keeps one step in flight while drafts pay.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from services.common.step import ExecutorInfo, StepPlan
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.engine.drafting import Drafting
from services.scheduler.engine.ports import EXECUTOR_LOST, ExecutorPort
from services.scheduler.engine.publisher import Publisher
from services.scheduler.engine.request_table import RequestTable
from services.scheduler.engine.step_times import StepTimeTotals
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.update import RequestUpdate

_log = structlog.get_logger("tokenmill.scheduler")


@dataclass(slots=True)
class _Sent:
    """A step sent to the executor whose result the lane has not read yet."""

    plan: StepPlan
    schedule_s: float
    send_s: float


@dataclass(slots=True)
class LaneContext:
    """What every lane of one engine shares."""

    limits: SchedulerLimits
    clock: Callable[[], float]
    requests: RequestTable
    publisher: Publisher
    totals: StepTimeTotals
    drafting: Drafting | None
    lost: Callable[[ExecutorLane, str], None]
    """Called when the lane's executor fails: the engine drops the lane and moves its requests."""
    updated: Callable[[ExecutorLane, list[RequestUpdate]], None] = lambda lane, updates: None
    """Called after each update, before the updates are published (prefill hand-off)."""

    def publish(self, lane: ExecutorLane, updates: list[RequestUpdate]) -> None:
        """Hand a step's updates to the output stage, with the text streams that close after it
        (those of requests it finished, and those ended meanwhile)."""
        self.updated(lane, updates)
        closed = self.requests.text.take_closed()
        for update in updates:
            stream = self.requests.get(update.request_id)
            if update.finish_reason is not None and stream is not None:
                closed.append((stream.stream_id, stream.detokenizer))
        self.publisher.put(updates, closed)

    def fail(self, failed: list[tuple[str, str]]) -> None:
        """End each (request id, error) the scheduler core gave up on."""
        for request_id, error in failed:
            stream = self.requests.get(request_id)
            if stream is not None:
                self.requests.end(stream, FinishReason.ERROR, error)


@dataclass(eq=False)
class ExecutorLane:
    """An executor's port, the scheduler core of its memory, and its steps in flight."""

    name: str
    port: ExecutorPort
    info: ExecutorInfo
    scheduler: Scheduler | None
    """None once the lane is dropped (its executor lost)."""
    context: LaneContext
    sent: deque[_Sent] = field(default_factory=deque)
    """Steps sent and not yet read, oldest first: one, or two with overlapped scheduling."""
    attached: bool = True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def role(self) -> str:
        return self.info.role

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Rounds until the lane is dropped (or the task cancelled); idle while nothing is planned."""
        while self.attached:
            if await self.round():
                await asyncio.sleep(0)  # let request handlers, other lanes and the output stage run
            else:
                self._wake.clear()
                await self._wake.wait()

    async def round(self) -> bool:
        """Plan and send until the pipeline is full (overlap depth) or nothing is left to plan,
        then receive the oldest step, update the scheduler core and queue its updates for the
        output stage. False when there was nothing to do."""
        if not self.attached:
            return False
        if not self.port.connected:
            # The executor went away between steps: handle it as a failed step now, not when
            # the next request is sent into it.
            self.context.lost(self, "the executor ended the step stream")
            return True
        await self._fill()
        if not self.attached:
            return True
        if not self.sent:
            closed = self.context.requests.text.take_closed()
            if closed:
                self.context.publisher.put([], closed)
            return False
        await self._receive()
        return True

    async def _fill(self) -> None:
        context = self.context
        overlap_depth = 2 if context.limits.overlap_scheduling else 1
        drafting = context.drafting
        depth = 1 if drafting is not None and drafting.speculating(self.scheduler) else overlap_depth
        while len(self.sent) < depth:
            started = time.perf_counter()
            if not self.sent and drafting is not None:
                await drafting.draft(self.scheduler)
                if not self.attached:
                    return
            plan = self.scheduler.schedule(context.clock())
            if plan.is_empty and not plan.finished_seq_ids:
                return
            scheduled = time.perf_counter()
            try:
                await self.port.send(plan)
            except EXECUTOR_LOST as exc:
                self._step_failed(plan, exc)
                return
            if self.sent:
                context.totals.overlapped += 1
            self.sent.append(_Sent(plan, scheduled - started, time.perf_counter() - scheduled))

    async def _receive(self) -> None:
        context = self.context
        sent = self.sent.popleft()
        plan = sent.plan
        waited = time.perf_counter()
        try:
            result = await self.port.receive(plan.step_id)
        except EXECUTOR_LOST as exc:
            self._step_failed(plan, exc)
            return
        if not self.attached:
            return
        stepped = time.perf_counter()
        try:
            updates = self.scheduler.update(plan, result)
        except ValueError as exc:  # the executor broke the step contract: it cannot be trusted
            _log.error("executor_result_invalid", executor=self.name, error=str(exc), step_id=plan.step_id)
            context.lost(self, f"the executor sent an invalid result for step {plan.step_id}: {exc}")
            return
        context.fail(self.scheduler.take_failed())
        context.totals.add_step(len(plan.new) + len(plan.running), sent.schedule_s, sent.send_s + stepped - waited,
                                result.execute_seconds, time.perf_counter() - stepped)
        context.publish(self, updates)

    def _step_failed(self, plan: StepPlan, exc: BaseException) -> None:
        _log.error("executor_step_failed", executor=self.name, error=str(exc), step_id=plan.step_id)
        self.context.lost(self, str(exc))
