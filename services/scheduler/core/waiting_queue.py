"""The waiting queue: requests waiting to start or to resume after a preemption, in scheduling
order, fair between tenants by a virtual token counter (VTC).

Order of the waiting queue: priority first (lower is more urgent), then, among the tenants
with a request waiting at that priority, the tenant that has been served the fewest tokens,
then arrival within the tenant (a preempted request keeps its original key, so it goes back
ahead of its tenant's later arrivals). With one tenant (authentication off: every request is
tenant "") this is exactly (priority, arrival_time, seq_id), the order without fairness.

The counter (Sheng et al., "Fairness in Serving Large Language Models", 2024): each tenant's
``served`` grows by the tokens computed for it, prompt tokens when a request starts and each
output token as it comes. A tenant that arrives with nothing waiting or running is lifted to
the smallest counter of the tenants that are active, less ``idle_credit`` tokens (the
scheduler gives one max_model_len): time spent idle is not banked as credit to flood with
later, beyond that one request's worth, which puts a light tenant's next request ahead of a
heavy tenant's backlog (and, core/preemption.py, lets it take a running slot from a tenant
far ahead). A tenant flooding at ten times its share thus waits behind every
other tenant's requests while its counter is ahead, and the others see their own unloaded
latency plus at most the step time of the flood's running requests.

The counters stay bounded however many tenants come and go (the gateway's API keys, each a
tenant): an idle tenant's counter is forgotten once it is at or below the level it would be
lifted to on return (forgetting it changes nothing), and beyond ``max_idle_tenants`` idle
counters the lowest are forgotten first (their tenants return level with the active ones,
which forgives them the least).

Pure: no clock, no I/O; the scheduler charges tokens (``charge``) and reports which tenants
still hold running requests (``set_running``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import count

from services.scheduler.request.request import Request


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; the caller should shed load."""


class WaitingQueue:
    """push, peek, pop, remove, len, in, iter over one heap per (priority, tenant), chosen
    between by the virtual token counter. A preempted request re-enters with its original key
    (so it goes back ahead of its tenant's later arrivals). Removal is lazy: the heap entry
    stays and is skipped later, which keeps remove O(1); ``len`` counts live entries only."""

    def __init__(self, idle_credit: float = 0.0, max_idle_tenants: int = 4096) -> None:
        if max_idle_tenants < 1:
            raise ValueError(f"max_idle_tenants must be >= 1, got {max_idle_tenants}")
        self.idle_credit = idle_credit
        self.max_idle_tenants = max_idle_tenants
        self._prune_at = 2 * max_idle_tenants
        """Counters kept before the next prune: amortized, each prune at most halves the map."""
        self._heaps: dict[tuple[int, str], list[tuple[tuple[int, float, int], int, Request]]] = {}
        self._live: dict[int, int] = {}
        """seq_id -> entry number of its live heap entry (older entries are stale)."""
        self._entry_numbers = count()
        self.served: dict[str, float] = {}
        """Tokens computed per tenant, lifted when a tenant returns from idle."""
        self._waiting_per_tenant: dict[str, int] = {}
        self._running_tenants: set[str] = set()

    # ---- the counter --------------------------------------------------------------------

    def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` computed for ``tenant`` (prompt at start, outputs as they come)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens

    def set_running(self, tenants: set[str]) -> None:
        """The tenants with running requests (active for the lift even with nothing waiting)."""
        self._running_tenants = tenants

    def _active(self) -> set[str]:
        return self._running_tenants | {t for t, n in self._waiting_per_tenant.items() if n}

    def _prune(self) -> None:
        """Forget idle tenants' counters: those a return would lift anyway, then the lowest
        beyond max_idle_tenants."""
        active = self._active()
        idle = [t for t in self.served if t not in active]
        if active:
            floor = min(self.served.get(t, 0.0) for t in active) - self.idle_credit
            for tenant in idle:
                if self.served[tenant] <= floor:
                    del self.served[tenant]
            idle = [t for t in idle if t in self.served]
        if len(idle) > self.max_idle_tenants:
            idle.sort(key=self.served.__getitem__)
            for tenant in idle[:len(idle) - self.max_idle_tenants]:
                del self.served[tenant]
        self._prune_at = max(2 * len(self.served), 2 * self.max_idle_tenants)

    # ---- the queue ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.seq_id in self._live

    def push(self, request: Request) -> None:
        if request.seq_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        tenant = request.tenant
        if tenant not in self.served and len(self.served) >= self._prune_at:
            self._prune()
        active = self._active()
        if tenant not in active:
            # Back from idle: start level with the least-served active tenant (less the idle
            # credit), never below where it left off (that would bank more credit).
            floor = min((self.served.get(t, 0.0) for t in active), default=0.0) - self.idle_credit
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
        entry_number = next(self._entry_numbers)
        self._live[request.seq_id] = entry_number
        self._waiting_per_tenant[tenant] = self._waiting_per_tenant.get(tenant, 0) + 1
        heapq.heappush(self._heaps.setdefault((request.priority, tenant), []),
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
            rank = (priority, self.served.get(tenant, 0.0), heap[0][0])
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
        remaining = self._waiting_per_tenant[request.tenant] - 1
        if remaining:
            self._waiting_per_tenant[request.tenant] = remaining
        else:
            del self._waiting_per_tenant[request.tenant]

    def _drop_stale_head(self, heap) -> None:
        while heap and self._live.get(heap[0][2].seq_id) != heap[0][1]:
            heapq.heappop(heap)
