"""Requests waiting to start or to resume after a preemption, in scheduling order."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

from services.scheduler.core.request import Request


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; the caller should shed load."""


class WaitingQueue:
    """A priority queue ordered by (priority, arrival_time, seq_id), lowest first.

    A preempted request re-enters with its original key, so it goes ahead of everything of its
    priority that arrived after it: "back at the front" in arrival terms, yet never ahead of a
    more urgent request. Removal (abort) is lazy: the heap entry stays and is skipped later,
    which keeps remove O(1); ``len`` counts live entries only.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], int, Request]] = []
        self._live: dict[int, int] = {}
        """seq_id -> entry number of its live heap entry (older entries are stale)."""
        self._entry_numbers = count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.seq_id in self._live

    def push(self, request: Request) -> None:
        if request.seq_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        entry_number = next(self._entry_numbers)
        self._live[request.seq_id] = entry_number
        heapq.heappush(self._heap, (request.sort_key, entry_number, request))

    def peek(self) -> Request | None:
        """The request to schedule next, or None."""
        self._drop_stale_head()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_stale_head()
        if not self._heap:
            raise IndexError("pop from an empty WaitingQueue")
        _, _, request = heapq.heappop(self._heap)
        del self._live[request.seq_id]
        return request

    def remove(self, request: Request) -> None:
        if self._live.pop(request.seq_id, None) is None:
            raise ValueError(f"request {request.request_id!r} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        """Live requests in scheduling order. O(n log n): for stats and debugging."""
        live = [e for e in self._heap if self._live.get(e[2].seq_id) == e[1]]
        return iter([request for _, _, request in sorted(live, key=lambda e: (e[0], e[1]))])

    def _drop_stale_head(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][2].seq_id) != heap[0][1]:
            heapq.heappop(heap)
