"""``latency``: each request to the cheapest target whose estimated response time fits its SLA.

For every healthy target the estimator (routing/estimate.py) gives the response time of this
request at the target's live load: TTFT + (max_tokens - 1) x TPOT, medians or, when the
request asks for the worst case, p99s. Then:

1. the targets whose estimate fits the request's SLA with ``confidence``: the estimate times the
   ``confidence`` quantile of the target's own observed / estimated ratios (a target whose
   estimates have run short gets a wider margin), cheapest first (ties: lower estimate); without
   an SLA, the targets whose estimate is within ``cheapest_within`` times the best target's
   (default 2) fit, so SLA-free traffic goes to the cheapest target that will not fall behind:
   as its queue grows its estimate grows with it, and past the bound the traffic spills to the
   next cheapest instead of piling up (a route's default ``sla_ms`` gives it an SLA instead);
2. then the targets that do not fit, lowest estimate first;
3. then the targets with no data yet.

Targets with no data (a fresh engine), or whose own observations have gone stale, are
explored slowly: with probability ``explore_rate`` such a target is put first, and never while
``max_exploring`` requests it was sent to learn from are still open, so a new engine is not
flooded before anything is known of it. With no data anywhere the least loaded target goes
first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

from services.gateway.routing.node import Ranking
from services.gateway.routing.request import RouteRequest
from services.gateway.routing.target import TargetState


class LatencyRouted:
    def __init__(self, targets: list[TargetState], *, explore_rate: float = 0.05, max_exploring: int = 1,
                 confidence: float = 0.9, cheapest_within: float = 2.0, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self.cheapest_within = cheapest_within
        self.confidence = confidence
        self.explore_rate = explore_rate
        self.max_exploring = max_exploring
        self.rng = rng or random.Random()
        self.clock = clock

    def rank(self, request: RouteRequest) -> Ranking:
        now = self.clock()
        tokens, worst, sla = request.expected_output_tokens, request.worst_case, request.sla_ms
        fits: list[tuple[float, float, TargetState]] = []
        misses: list[tuple[float, TargetState]] = []
        unknown: list[TargetState] = []
        learn: list[TargetState] = []
        confidence = self.confidence
        n1 = tokens - 1 if tokens > 1 else 0
        for target in self.targets:
            if not target.healthy:
                continue
            estimator = target.estimator
            c = estimator.coefficients(now)
            if c is None:
                unknown.append(target)
                if target.exploring < self.max_exploring:
                    learn.append(target)
                continue
            # raw_estimate_ms, inlined: this loop runs over every target for every request
            inflight = target.inflight
            load = target.profile_load + inflight - target.inflight_at_read if target.profile_load >= 0 else inflight
            if load < inflight:
                load = inflight
            ttft_a, ttft_b, ttft_floor, tpot_a, tpot_b, tpot_floor, worst_ttft, worst_tpot = c
            ttft = ttft_a + ttft_b * load
            if ttft < ttft_floor:
                ttft = ttft_floor
            tpot = tpot_a + tpot_b * load
            if tpot < tpot_floor:
                tpot = tpot_floor
            raw = ttft * worst_ttft + n1 * tpot * worst_tpot if worst else ttft + n1 * tpot
            estimate = raw * estimator.median_ratio
            if sla is None or raw * estimator.quantile_ratio(confidence) <= sla:  # SLA-free: sorted out below
                fits.append((target.cost, estimate, target))
            else:
                misses.append((estimate, target))
            if target.exploring < self.max_exploring and now - estimator.last_observed_at > estimator.stale_after_s \
                    and estimator.is_stale(now):
                learn.append(target)
        if not fits and not misses:
            return self._without_data(unknown)
        if sla is None:
            bound = self.cheapest_within * min(entry[1] for entry in fits)
            misses = [(estimate, t) for _, estimate, t in fits if estimate > bound]
            fits = [entry for entry in fits if entry[1] <= bound]
        fits.sort(key=lambda entry: (entry[0], entry[1]))
        misses.sort(key=lambda entry: entry[0])
        ranked = [t for _, _, t in fits] + [t for _, t in misses] + unknown
        if learn and self.rng.random() < self.explore_rate:
            chosen = min(learn, key=lambda t: t.inflight)
            ranked.remove(chosen)
            return Ranking([chosen, *ranked], "explore", explore=True,
                           estimate_ms=chosen.estimate_ms(tokens, worst, now))
        if fits:
            reason = "cheapest" if sla is None else "sla_cheapest"
            return Ranking(ranked, reason, estimate_ms=fits[0][1])
        return Ranking(ranked, "lowest_estimate", estimate_ms=misses[0][0])

    def _without_data(self, unknown: list[TargetState]) -> Ranking:
        if not unknown:
            return Ranking([], "no_healthy_target")
        unknown.sort(key=lambda t: (t.inflight, t.cost))
        return Ranking(unknown, "no_data_least_loaded", explore=True)

    def leaves(self) -> Iterator[TargetState]:
        return iter(self.targets)
