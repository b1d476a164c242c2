"""Requests that lost their executor while no other was attached: they wait for one to come back.

Each waits at most ``wait_s`` (SchedulerLimits.executor_wait_s), then ends with one Finished
(error); 0 ends it at once. A request that ends otherwise meanwhile (abort, deadline) just
leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.scheduler.request.request import Request


class ParkedRequests:
    def __init__(self, wait_s: float, expire: Callable[[str], None]) -> None:
        self._wait_s = wait_s
        self._expire = expire
        """Called with a request id whose wait ran out (the engine ends the request)."""
        self._parked: dict[str, Request] = {}

    def park(self, request: Request) -> None:
        if not self._wait_s:
            self._expire(request.request_id)
            return
        self._parked[request.request_id] = request
        asyncio.get_running_loop().call_later(self._wait_s, self._timed_out, request.request_id)

    def take_all(self) -> list[Request]:
        """Every parked request, oldest first (an executor came back)."""
        parked, self._parked = list(self._parked.values()), {}
        return parked

    def forget(self, request_id: str) -> None:
        self._parked.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._parked)

    def _timed_out(self, request_id: str) -> None:
        if self._parked.pop(request_id, None) is not None:
            self._expire(request_id)
