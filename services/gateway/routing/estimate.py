"""A target's response time for one request: TTFT + (tokens - 1) x TPOT, each a function of the load.

In-flight batching raises every running request's latency as the batch grows, so a fixed
threshold on a profile read a while ago goes wrong exactly when it matters. The estimator
keeps two small regressions per target, fitted on the gateway's own observations of that
target (each finished request gives one point):

    TTFT(load) = a + b * load        time from dispatch to the first token, as the client sees it
    TPOT(load) = c + d * load        time per output token after the first

``load`` is the number of requests on the engine when the request was dispatched (running
plus waiting from the last GetProfile, plus what this gateway sent since). The fits weigh
recent points more (each point's weight decays by ``DECAY`` per later point), so they follow a
target that slows down or speeds up. Slopes are kept >= 0: more load never makes a target
faster. Points seen at nearly one load say nothing about the slope, so the slope is pulled
toward a prior, ``PRIOR_SLOWDOWN`` of the mean per request in flight (ridge regression with
``PRIOR_WEIGHT``), which the data outweighs as soon as it spans a few loads.

The fitted estimate is then calibrated on its own errors: each finished request leaves the
ratio observed / estimated (the load a request meets changes after it is sent, output may end
early), and the last ``RATIO_WINDOW`` ratios give quantiles. ``estimate_ms`` scales the raw
estimate by the median ratio (the best guess), ``quantile_ratio(q)`` gives the margin a
strategy needs to be right a fraction q of the time (the latency strategy's ``confidence``).

Until a target has ``MIN_OBSERVATIONS`` points of its own (or when they have gone stale while
the engine's profile has recent data), its live profile stands in: TTFT and TPOT medians
measured by the engine over its recent window, at whatever load it had. For the worst case the
values are scaled by the profile's p99/p50 ratios (so the profile's own p99s;
``WORST_CASE_FALLBACK`` when the profile has no data).
"""

from __future__ import annotations

from collections import deque

from services.gateway.routing.profile import ProfileView

DECAY = 0.97
"""Weight kept by a point per newer point (about the last 33 points count)."""
MIN_OBSERVATIONS = 3
WORST_CASE_FALLBACK = 2.0
MAX_WORST_CASE_RATIO = 10.0
PRIOR_SLOWDOWN = 0.05
"""Relative latency a request in flight adds before the data says otherwise (in-flight batching)."""
PRIOR_WEIGHT = 4.0
"""Weight of the slope's prior, in points one load unit from the mean."""
RATIO_WINDOW = 64
MIN_RATIOS = 8
"""Calibration starts once this many ratios were seen (before: ratio 1)."""


class DecayingLine:
    """y = intercept + slope * x by least squares over exponentially decayed points."""

    __slots__ = ("_w", "_sx", "_sy", "_sxx", "_sxy", "count", "intercept", "slope", "floor")

    def __init__(self) -> None:
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.count = 0
        self.intercept = self.slope = 0.0
        self.floor = 0.0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + x
        self._sy = self._sy * d + y
        self._sxx = self._sxx * d + x * x
        self._sxy = self._sxy * d + x * y
        self.count += 1
        w = self._w
        mean_x, mean_y = self._sx / w, self._sy / w
        sxx = max(self._sxx - w * mean_x * mean_x, 0.0)  # sum of w (x - mean_x)^2
        sxy = self._sxy - w * mean_x * mean_y
        prior = PRIOR_SLOWDOWN * mean_y / (1.0 + PRIOR_SLOWDOWN * mean_x)
        slope = (sxy + PRIOR_WEIGHT * prior) / (sxx + PRIOR_WEIGHT)
        self.slope = slope if slope > 0.0 else 0.0
        self.intercept = mean_y - self.slope * mean_x
        # Extrapolating a steep line below the loads it saw could go negative: never below a
        # quarter of the mean.
        self.floor = 0.25 * mean_y

    def predict(self, x: float) -> float:
        y = self.intercept + self.slope * x
        return y if y > self.floor else self.floor


class ResponseTimeEstimator:
    """One target's TTFT and TPOT fits, and its profile as the fallback.

    A routing decision reads every target's estimate, so the coefficients in use (the fits', or
    the profile's) are kept as one tuple, rebuilt only when an observation or a profile arrives
    or the fits go stale: an estimate is then a handful of float operations.
    """

    __slots__ = ("ttft", "tpot", "profile", "last_observed_at", "stale_after_s", "_worst_ttft", "_worst_tpot",
                 "_ratios", "_sorted_ratios", "median_ratio", "_coefficients", "_dirty", "_own_until",
                 "_quantiles")

    def __init__(self, stale_after_s: float = 30.0) -> None:
        self.ttft = DecayingLine()
        self.tpot = DecayingLine()
        self.profile: ProfileView | None = None
        self.last_observed_at = float("-inf")
        """Clock of the last observation."""
        self.stale_after_s = stale_after_s
        """Own observations older than this give way to a profile that has data."""
        self._worst_ttft = self._worst_tpot = WORST_CASE_FALLBACK
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._sorted_ratios: list[float] = []
        self.median_ratio = 1.0
        self._coefficients: tuple[float, ...] | None = None
        self._dirty = True
        self._own_until = float("inf")
        """While the coefficients are the fits': when they go stale."""
        self._quantiles: dict[float, float] = {}

    def quantile_ratio(self, q: float) -> float:
        """The q-quantile of observed / raw estimate over the last requests (1 before MIN_RATIOS)."""
        value = self._quantiles.get(q)
        if value is None:
            ordered = self._sorted_ratios
            value = 1.0 if len(ordered) < MIN_RATIOS else ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            self._quantiles[q] = value
        return value

    def estimate_ms(self, output_tokens: int, load: float, worst_case: bool, now: float) -> float | None:
        """The calibrated estimate: the raw one times the median observed / estimated ratio."""
        raw = self.raw_estimate_ms(output_tokens, load, worst_case, now)
        return None if raw is None else raw * self.median_ratio

    def set_profile(self, profile: ProfileView) -> None:
        self.profile = profile
        if profile.has_latency:
            self._worst_ttft = _ratio(profile.ttft_p99_ms, profile.ttft_p50_ms)
            self._worst_tpot = _ratio(profile.tpot_p99_ms, profile.tpot_p50_ms)
        self._dirty = True

    def is_stale(self, now: float) -> bool:
        """The estimate rests on old points alone: no observation of our own for ``stale_after_s``
        and no recent requests in the engine's profile, so it may describe a load long gone."""
        profile = self.profile
        return (now - self.last_observed_at > self.stale_after_s
                and (profile is None or not profile.has_latency))

    def coefficients(self, now: float) -> tuple[float, ...] | None:
        """(ttft intercept, slope, floor, tpot intercept, slope, floor, worst-case ttft and tpot
        factors), or None without data."""
        if self._dirty or now > self._own_until:
            self._coefficients = self._build(now)
            self._dirty = False
        return self._coefficients

    def _build(self, now: float) -> tuple[float, ...] | None:
        profile = self.profile
        with_profile = profile is not None and profile.has_latency
        self._own_until = float("inf")
        if self.ttft.count >= MIN_OBSERVATIONS:
            own_until = self.last_observed_at + self.stale_after_s
            if now <= own_until or not with_profile:  # else the engine's recent window knows better
                if with_profile:
                    self._own_until = own_until
                t, p = self.ttft, self.tpot
                return (t.intercept, t.slope, t.floor, p.intercept, p.slope, p.floor, self._worst_ttft,
                        self._worst_tpot)
        if not with_profile:
            return None
        tpot = profile.tpot_p50_ms
        if tpot <= 0.0 and profile.tokens_per_second_per_stream > 0:
            tpot = 1000.0 / profile.tokens_per_second_per_stream
        return profile.ttft_p50_ms, 0.0, 0.0, tpot, 0.0, 0.0, self._worst_ttft, self._worst_tpot

    def raw_estimate_ms(self, output_tokens: int, load: float, worst_case: bool, now: float) -> float | None:
        """Expected response time in ms for ``output_tokens`` tokens at ``load`` from the fits (or the
        profile: its medians, its p99s for the worst case), before calibration; None without data."""
        c = self.coefficients(now)
        if c is None:
            return None
        ttft_a, ttft_b, ttft_floor, tpot_a, tpot_b, tpot_floor, worst_ttft, worst_tpot = c
        ttft = ttft_a + ttft_b * load
        if ttft < ttft_floor:
            ttft = ttft_floor
        tpot = tpot_a + tpot_b * load
        if tpot < tpot_floor:
            tpot = tpot_floor
        if worst_case:
            ttft *= worst_ttft
            tpot *= worst_tpot
        return ttft + (output_tokens - 1 if output_tokens > 1 else 0) * tpot

    def observe(self, load: float, ttft_ms: float, output_tokens: int, e2e_ms: float, now: float,
                raw_estimate_ms: float | None = None) -> None:
        """One finished request of this target, as the gateway timed it; ``raw_estimate_ms`` is what
        raw_estimate_ms said for it at dispatch (for its actual output), for the calibration."""
        self.last_observed_at = now
        self._dirty = True
        if raw_estimate_ms is not None and raw_estimate_ms > 0 and e2e_ms > 0:
            self._ratios.append(e2e_ms / raw_estimate_ms)
            self._sorted_ratios = sorted(self._ratios)
            self._quantiles.clear()
            if len(self._sorted_ratios) >= MIN_RATIOS:
                self.median_ratio = self._sorted_ratios[len(self._sorted_ratios) // 2]
        self.ttft.add(load, ttft_ms)
        if output_tokens > 1:
            self.tpot.add(load, max(e2e_ms - ttft_ms, 0.0) / (output_tokens - 1))
        elif self.tpot.count == 0 and self.profile is not None and self.profile.tpot_p50_ms > 0:
            self.tpot.add(load, self.profile.tpot_p50_ms)


def _ratio(p99: float, p50: float) -> float:
    if p50 <= 0.0 or p99 <= 0.0:
        return WORST_CASE_FALLBACK
    return min(max(p99 / p50, 1.0), MAX_WORST_CASE_RATIO)
