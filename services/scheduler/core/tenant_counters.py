"""The virtual token counter (VTC) that makes the waiting queue fair between tenants.

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


class TenantCounters:
    """Tokens served per tenant, lifted on a return from idle, bounded in number."""

    def __init__(self, idle_credit: float = 0.0, max_idle_tenants: int = 4096) -> None:
        if max_idle_tenants < 1:
            raise ValueError(f"max_idle_tenants must be >= 1, got {max_idle_tenants}")
        self.idle_credit = idle_credit
        self.max_idle_tenants = max_idle_tenants
        self._prune_at = 2 * max_idle_tenants
        """Counters kept before the next prune: amortized, each prune at most halves the map."""
        self.served: dict[str, float] = {}
        """Tokens computed per tenant, lifted when a tenant returns from idle."""
        self._waiting: dict[str, int] = {}
        self._running: set[str] = set()

    def charge(self, tenant: str, tokens: int) -> None:
        """Count ``tokens`` computed for ``tenant`` (prompt at start, outputs as they come)."""
        self.served[tenant] = self.served.get(tenant, 0.0) + tokens

    def set_running(self, tenants: set[str]) -> None:
        """The tenants with running requests (active for the lift even with nothing waiting)."""
        self._running = tenants

    def level(self, tenant: str) -> float:
        return self.served.get(tenant, 0.0)

    def arrive(self, tenant: str) -> None:
        """One more request of ``tenant`` waits."""
        if tenant not in self.served and len(self.served) >= self._prune_at:
            _forget_idle(self.served, self._active(), self.idle_credit, self.max_idle_tenants)
            self._prune_at = max(2 * len(self.served), 2 * self.max_idle_tenants)
        active = self._active()
        if tenant not in active:
            # Back from idle: start level with the least-served active tenant (less the idle
            # credit), never below where it left off (that would bank more credit).
            floor = min((self.served.get(t, 0.0) for t in active), default=0.0) - self.idle_credit
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        """One request of ``tenant`` no longer waits."""
        remaining = self._waiting[tenant] - 1
        if remaining:
            self._waiting[tenant] = remaining
        else:
            del self._waiting[tenant]

    def _active(self) -> set[str]:
        return self._running | {t for t, n in self._waiting.items() if n}


def _forget_idle(served: dict[str, float], active: set[str], idle_credit: float, max_idle_tenants: int) -> None:
    """Forget idle tenants' counters: those a return would lift anyway, then the lowest
    beyond max_idle_tenants."""
    idle = [t for t in served if t not in active]
    if active:
        floor = min(served.get(t, 0.0) for t in active) - idle_credit
        for tenant in idle:
            if served[tenant] <= floor:
                del served[tenant]
        idle = [t for t in idle if t in served]
    if len(idle) > max_idle_tenants:
        idle.sort(key=served.__getitem__)
        for tenant in idle[:len(idle) - max_idle_tenants]:
            del served[tenant]
