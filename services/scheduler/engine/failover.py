"""Requests whose executor is lost: each moves to another executor, or waits for one.

A move is a preemption by recompute: the engine knows every token of every request, so each
restarts from its known tokens on the executor placement chooses (a decode executor once it
has outputs) and its stream goes on. With no executor attached it parks (parking.py) until
one comes back, or ends with NO_EXECUTOR_LEFT after ``executor_wait_s``. A request whose KV
copy failed (handoff.py) comes back through ``requeue`` too.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from services.scheduler.engine.lane import ExecutorLane
from services.scheduler.engine.lane_tasks import LaneTasks
from services.scheduler.engine.parking import ParkedRequests
from services.scheduler.engine.placement import ANY_ROLE, ROLES_FOR_DECODE, ROLES_FOR_NEW, choose_lane
from services.scheduler.engine.request_table import RequestTable
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request

_log = structlog.get_logger("tokenmill.scheduler")

NO_EXECUTOR_LEFT = "no executor came back within executor_wait_s"


class Failover:
    def __init__(self, lanes: dict[str, ExecutorLane], requests: RequestTable, tasks: LaneTasks,
                 executor_wait_s: float, on_executor_lost: Callable[[str, str], None]) -> None:
        self._lanes = lanes
        self._requests = requests
        self._tasks = tasks
        self._on_executor_lost = on_executor_lost
        self.parked = ParkedRequests(executor_wait_s, self._no_executor_left)
        """Requests whose executor was lost with no other to take them, waiting for one."""

    def lost(self, lane: ExecutorLane, error: str) -> None:
        """Drop the lane (its scheduler core described the lost executor's memory) and move
        each of its requests to another executor, or park it until one comes back."""
        if self._lanes.get(lane.name) is not lane:
            return
        _log.error("executor_lost", executor=lane.name, error=error, requests=len(lane.scheduler.requests))
        del self._lanes[lane.name]
        lane.attached = False
        lane.wake()
        self._tasks.stop(lane)
        for request in sorted(lane.scheduler.requests.values(), key=lambda r: r.sort_key):
            if self._requests.get(request.request_id) is not None:
                request.leave_executor()
                self.requeue(request)
        # The lane's task may still be on its way out; its scheduler core (whose free-block
        # list is a cycle) becomes garbage now, for the owner's next collection.
        lane.scheduler = None
        self._on_executor_lost(lane.name, error)

    def requeue(self, request: Request) -> ExecutorLane | None:
        """Queue a request that left its executor (Request.leave_executor) on another, to
        recompute what it lost (a decode executor once it has outputs); park it when none is
        attached. Returns the lane it went to."""
        lanes = list(self._lanes.values())
        roles = ROLES_FOR_DECODE if request.num_output_tokens else ROLES_FOR_NEW
        lane = choose_lane(request, lanes, roles) or choose_lane(request, lanes, ANY_ROLE)
        if lane is None:
            self.parked.park(request)
            return None
        lane.scheduler.add_request(request, moved=True)
        lane.wake()
        return lane

    def _no_executor_left(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        if stream is not None:
            self._requests.end(stream, FinishReason.ERROR, NO_EXECUTOR_LEFT)
