"""The steps a lane sent to its executor and has not read back yet, and what each one cost.

One, or two with overlapped scheduling (engine/lane.py), oldest first: results come back in
the order the plans went out, so the oldest is always the one to read next. Each step's
times go to the engine's ``StepTimeTotals`` once the scheduler core has applied it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.common.step import StepPlan, StepResult
from services.scheduler.engine.ports import EXECUTOR_LOST, ExecutorPort
from services.scheduler.engine.step_times import StepTimeTotals

_log = structlog.get_logger("tokenmill.scheduler")


@dataclass(slots=True)
class SentStep:
    """A step sent to the executor whose result the lane has not read yet."""

    plan: StepPlan
    schedule_s: float
    executor_s: float
    """Sending the plan; once received, plus the wait for its result."""
    received: float = 0.0
    """perf_counter() when its result arrived: the update starts there."""


class SentSteps:
    """``lost``: called with the error when sending or receiving fails (the executor is gone)."""

    def __init__(self, name: str, port: ExecutorPort, totals: StepTimeTotals, lost: Callable[[str], None]) -> None:
        self._name = name
        self._port = port
        self._totals = totals
        self._lost = lost
        self._sent: deque[SentStep] = deque()

    def __len__(self) -> int:
        return len(self._sent)

    def connected(self) -> bool:
        """False, reported as a loss, when the executor went away between steps: that is
        handled as a failed step now, not when the next request is sent into it."""
        if not self._port.connected:
            self._lost("the executor ended the step stream")
        return self._port.connected

    async def send(self, plan: StepPlan, started: float) -> bool:
        """Send ``plan``, planned (drafts asked for included) since ``started`` (perf_counter).
        False when the executor is lost."""
        scheduled = time.perf_counter()
        try:
            await self._port.send(plan)
        except EXECUTOR_LOST as exc:
            self._failed(plan, exc)
            return False
        if self._sent:
            self._totals.overlapped += 1
        self._sent.append(SentStep(plan, scheduled - started, time.perf_counter() - scheduled))
        return True

    async def receive(self) -> tuple[SentStep, StepResult] | None:
        """Take the oldest step and wait for its result; None when the executor is lost."""
        sent = self._sent.popleft()
        waited = time.perf_counter()
        try:
            result = await self._port.receive(sent.plan.step_id)
        except EXECUTOR_LOST as exc:
            return self._failed(sent.plan, exc)
        sent.received = time.perf_counter()
        sent.executor_s += sent.received - waited
        return sent, result

    def applied(self, sent: SentStep, result: StepResult) -> None:
        """The scheduler core applied ``result``: add the step's times to the totals."""
        plan = sent.plan
        self._totals.add_step(len(plan.new) + len(plan.running), sent.schedule_s, sent.executor_s,
                              result.execute_seconds, time.perf_counter() - sent.received)

    def _failed(self, plan: StepPlan, exc: BaseException) -> None:
        _log.error("executor_step_failed", executor=self._name, error=str(exc), step_id=plan.step_id)
        self._lost(str(exc))
