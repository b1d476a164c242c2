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
step at a time. Speculation (drafting.py) keeps one step in flight while drafts pay. The
steps in flight, a lost executor's report and each step's times are sent_steps.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from services.common.step import ExecutorInfo, StepResult
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.engine.drafting import Drafting
from services.scheduler.engine.ports import ExecutorPort
from services.scheduler.engine.publisher import Publisher
from services.scheduler.engine.request_table import RequestTable
from services.scheduler.engine.sent_steps import SentStep, SentSteps
from services.scheduler.engine.step_times import StepTimeTotals
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.update import RequestUpdate

_log = structlog.get_logger("tokenmill.scheduler")


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

    def publish_closed(self) -> None:
        """Close the text streams ended while no step was in flight (no step will carry them)."""
        closed = self.requests.text.take_closed()
        if closed:
            self.publisher.put([], closed)

    def depth(self, scheduler: Scheduler) -> int:
        """Steps a lane keeps in flight: two with overlapped scheduling, one while a request of
        its scheduler would verify drafts (see drafting.py)."""
        if self.drafting is not None and self.drafting.speculating(scheduler):
            return 1
        return 2 if self.limits.overlap_scheduling else 1

    def apply(self, lane: ExecutorLane, sent: SentStep, result: StepResult) -> None:
        """Update the lane's scheduler core with a step's result, end the requests it failed and
        publish its updates; an invalid result loses the lane (its executor cannot be trusted)."""
        try:
            updates = lane.scheduler.update(sent.plan, result)
        except ValueError as exc:
            step_id = sent.plan.step_id
            _log.error("executor_result_invalid", executor=lane.name, error=str(exc), step_id=step_id)
            return self.lost(lane, f"the executor sent an invalid result for step {step_id}: {exc}")
        self.fail(lane.scheduler.take_failed())
        lane.sent.applied(sent, result)
        self.publish(lane, updates)

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
    attached: bool = True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.sent = SentSteps(self.name, self.port, self.context.totals, lambda error: self.context.lost(self, error))

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
        if not self.sent.connected():
            return True
        await self._fill()
        if not self.attached:
            return True
        if not self.sent:
            self.context.publish_closed()
            return False
        received = await self.sent.receive()
        if received is not None and self.attached:
            self.context.apply(self, *received)
        return True

    async def _fill(self) -> None:
        while len(self.sent) < self.context.depth(self.scheduler):
            started = time.perf_counter()
            if not self.sent and self.context.drafting is not None:
                await self.context.drafting.draft(self.scheduler)
                if not self.attached:
                    return
            plan = self.scheduler.schedule(self.context.clock())
            if (plan.is_empty and not plan.finished_seq_ids) or not await self.sent.send(plan, started):
                return
