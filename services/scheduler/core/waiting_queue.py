"""The waiting queue: requests waiting to start or to resume after a preemption, in scheduling
order, fair between tenants by a virtual token counter (VTC).

Order of the waiting queue: priority first (lower is more urgent), then, among the tenants
with a request waiting at that priority, the tenant that has been served the fewest tokens,
then arrival within the tenant (a preempted request keeps its original key, so it goes back
ahead of its tenant's later arrivals). With one tenant (authentication off: every request is
tenant "") this is exactly (priority, arrival_time, seq_id), the order without fairness.

The tenants' counters (how many tokens each was served, and how an idle tenant returns) are
tenant_counters.py.

Pure: no clock, no I/O.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

from services.scheduler.core.tenant_counters import TenantCounters
from services.scheduler.request.request import Request


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; the caller should shed load."""


class WaitingQueue:
    """push, peek, pop, remove, len, in, iter over one heap per (priority, tenant), chosen
    between by the virtual token counter. A preempted request re-enters with its original key
    (so it goes back ahead of its tenant's later arrivals). Removal is lazy: the heap entry
    stays and is skipped later, which keeps remove O(1); ``len`` counts live entries only."""

    def __init__(self, idle_credit: float = 0.0, max_idle_tenants: int = 4096) -> None:
        self.counters = TenantCounters(idle_credit, max_idle_tenants)
        # The scheduler feeds the counters through the queue that orders by them.
        counters = self.counters
        self.charge, self.set_running, self.served = counters.charge, counters.set_running, counters.served
        self._heaps: dict[tuple[int, str], list[tuple[tuple[int, float, int], int, Request]]] = {}
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
        self.counters.arrive(request.tenant)
        entry_number = next(self._entry_numbers)
        self._live[request.seq_id] = entry_number
        heapq.heappush(self._heaps.setdefault((request.priority, request.tenant), []),
                       (request.sort_key, entry_number, request))

    def peek(self) -> Request | None:
        """The request to schedule next, or None."""
        best = None
        emptied = []
        for key, heap in self._heaps.items():
            self._drop_stale_head(heap)
            if not heap:
                emptied.append(key)  # only removed entries were left
                continue
            priority, tenant = key
            # priority, then the tenant's counter, then the head's own (arrival) key.
            rank = (priority, self.counters.level(tenant), heap[0][0])
            if best is None or rank < best[0]:
                best = (rank, heap[0][2])
        for key in emptied:
            del self._heaps[key]
        return best[1] if best is not None else None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty WaitingQueue")
        heap = self._heaps[(request.priority, request.tenant)]
        heapq.heappop(heap)
        if not heap:
            del self._heaps[(request.priority, request.tenant)]
        self._forget(request)
        return request

    def remove(self, request: Request) -> None:
        if request.seq_id not in self._live:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        self._forget(request)

    def __iter__(self) -> Iterator[Request]:
        """Live requests by (priority, arrival). O(n log n): for stats and debugging."""
        live = [e for heap in self._heaps.values() for e in heap if self._live.get(e[2].seq_id) == e[1]]
        return iter([request for _, _, request in sorted(live, key=lambda e: (e[0], e[1]))])

    def _forget(self, request: Request) -> None:
        del self._live[request.seq_id]
        self.counters.leave(request.tenant)

    def _drop_stale_head(self, heap) -> None:
        while heap and self._live.get(heap[0][2].seq_id) != heap[0][1]:
            heapq.heappop(heap)
