"""The live state of one routing target, as the pool keeps it and the strategies read it.

Strategies only read; the pool (health, profiles) and the dispatcher (in-flight counts,
outcomes) write. Everything runs on the gateway's one event loop, so there are no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.routing.estimate import ResponseTimeEstimator
from services.gateway.routing.profile import ProfileView


@dataclass(eq=False, slots=True)
class TargetState:
    name: str
    cost: float = 1.0
    """Relative price of a generated token here; the latency strategy takes the cheapest that fits."""
    tags: tuple[str, ...] = ()
    healthy: bool = False
    """In the pool: health SERVING and the last calls succeeded. Out: skipped by every strategy."""
    inflight: int = 0
    """Requests this gateway has open on the target now."""
    inflight_at_read: int = 0
    """``inflight`` when the profile was read: what the engine's own counts already include."""
    profile_load: int = -1
    """running + waiting of the last profile (-1: none read yet)."""
    max_concurrency: int = 0
    """Requests the target runs at once (0: no bound); at it, the route's others go first."""
    exploring: int = 0
    """Requests in flight that were sent to learn the target's latency (not on its estimate)."""
    estimator: ResponseTimeEstimator = field(default_factory=ResponseTimeEstimator)

    def set_profile(self, profile: ProfileView) -> None:
        self.estimator.set_profile(profile)
        self.inflight_at_read = self.inflight
        self.profile_load = profile.num_running + profile.num_waiting

    def engine_load(self) -> float:
        """Requests on the engine now: its running + waiting when last read, plus what this
        gateway sent since; never less than what this gateway has open there."""
        inflight = self.inflight
        if self.profile_load < 0:
            return float(inflight)
        load = self.profile_load + inflight - self.inflight_at_read
        return float(load if load > inflight else inflight)

    def estimate_ms(self, output_tokens: int, worst_case: bool, now: float) -> float | None:
        """The calibrated estimate of a response at the live load (None without data)."""
        return self.estimator.estimate_ms(output_tokens, self.engine_load(), worst_case, now)

    def raw_estimate_ms(self, output_tokens: int, worst_case: bool, now: float) -> float | None:
        return self.estimator.raw_estimate_ms(output_tokens, self.engine_load(), worst_case, now)


def with_room_first(ranked: list[TargetState]) -> list[TargetState]:
    """The ranking with the targets whose every slot the gateway holds (``max_concurrency``) moved
    after the others, in their order: a request sent there would queue behind them, which no
    estimate made from finished requests foresees. Still tried last rather than dropped."""
    full = [t for t in ranked if t.max_concurrency and t.inflight >= t.max_concurrency]
    if not full:
        return ranked
    return [t for t in ranked if not (t.max_concurrency and t.inflight >= t.max_concurrency)] + full
