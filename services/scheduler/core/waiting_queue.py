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


class _LazyHeaps:
    """One heap per (priority, tenant) of (sort key, entry number, request). Removal is lazy:
    the heap entry stays and is skipped later, which keeps remove O(1); ``len`` counts live
    entries only."""

    def __init__(self) -> None:
        self.heaps: dict[tuple[int, str], list[tuple[tuple[int, float, int], int, Request]]] = {}
        self.live: dict[int, int] = {}
        """seq_id -> entry number of its live heap entry (older entries are stale)."""
        self._entry_numbers = count()

    def push(self, request: Request) -> None:
        entry_number = next(self._entry_numbers)
        self.live[request.seq_id] = entry_number
        heapq.heappush(self.heaps.setdefault((request.priority, request.tenant), []),
                       (request.sort_key, entry_number, request))

    def heads(self) -> Iterator[tuple[int, str, tuple[int, float, int], Request]]:
        """(priority, tenant, sort key, request) of each heap's live head; heaps left with only
        removed entries are dropped."""
        for key, heap in list(self.heaps.items()):
            while heap and self.live.get(heap[0][2].seq_id) != heap[0][1]:
                heapq.heappop(heap)
            if not heap:
                del self.heaps[key]
                continue
            yield key[0], key[1], heap[0][0], heap[0][2]

    def pop_head(self, request: Request) -> None:
        """Take ``request``, its heap's live head, off its heap."""
        key = (request.priority, request.tenant)
        heapq.heappop(self.heaps[key])
        if not self.heaps[key]:
            del self.heaps[key]

    def __iter__(self) -> Iterator[Request]:
        """Live requests by (priority, arrival). O(n log n): for stats and debugging."""
        live = [e for heap in self.heaps.values() for e in heap if self.live.get(e[2].seq_id) == e[1]]
        return iter([request for _, _, request in sorted(live, key=lambda e: (e[0], e[1]))])


class WaitingQueue:
    """push, peek, pop, remove, len, in, iter over one heap per (priority, tenant), chosen
    between by the virtual token counter. A preempted request re-enters with its original key
    (so it goes back ahead of its tenant's later arrivals)."""

    def __init__(self, idle_credit: float = 0.0, max_idle_tenants: int = 4096) -> None:
        self.counters = TenantCounters(idle_credit, max_idle_tenants)
        # The scheduler feeds the counters through the queue that orders by them.
        counters = self.counters
        self.charge, self.set_running, self.served = counters.charge, counters.set_running, counters.served
        self._heaps = _LazyHeaps()

    def __len__(self) -> int:
        return len(self._heaps.live)

    def __contains__(self, request: Request) -> bool:
        return request.seq_id in self._heaps.live

    def __iter__(self) -> Iterator[Request]:
        return iter(self._heaps)

    def push(self, request: Request) -> None:
        if request.seq_id in self._heaps.live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self.counters.arrive(request.tenant)
        self._heaps.push(request)

    def peek(self) -> Request | None:
        """The request to schedule next, or None: by priority, then the tenant's counter, then
        the head's own (arrival) key."""
        ranked = ((priority, self.counters.level(tenant), key, request)
                  for priority, tenant, key, request in self._heaps.heads())
        best = min(ranked, key=lambda rank: rank[:3], default=None)
        return best[3] if best is not None else None

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty WaitingQueue")
        self._heaps.pop_head(request)
        self._forget(request)
        return request

    def remove(self, request: Request) -> None:
        if request.seq_id not in self._heaps.live:
            raise ValueError(f"request {request.request_id!r} is not waiting")
        self._forget(request)

    def _forget(self, request: Request) -> None:
        del self._heaps.live[request.seq_id]
        self.counters.leave(request.tenant)
