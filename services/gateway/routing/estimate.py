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

Until a target has ``MIN_OBSERVATIONS`` points of its own, its live profile stands in: TTFT and
TPOT medians (p99s for the worst case) measured by the engine over its recent window, at
whatever load it had. For the worst case a fitted value is scaled by the profile's p99/p50
ratio (``WORST_CASE_FALLBACK`` when the profile has no data).
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
    """One target's TTFT and TPOT fits, and its profile as the fallback."""

    __slots__ = ("ttft", "tpot", "profile", "last_observed_at", "stale_after_s", "_worst_ttft", "_worst_tpot",
                 "_ratios", "_sorted_ratios", "median_ratio")

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

    def quantile_ratio(self, q: float) -> float:
        """The q-quantile of observed / raw estimate over the last requests (1 before MIN_RATIOS)."""
        ordered = self._sorted_ratios
        if len(ordered) < MIN_RATIOS:
            return 1.0
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def estimate_ms(self, output_tokens: int, load: float, worst_case: bool, now: float) -> float | None:
        """The calibrated estimate: the raw one times the median observed / estimated ratio."""
        raw = self.raw_estimate_ms(output_tokens, load, worst_case, now)
        return None if raw is None else raw * self.median_ratio

    def set_profile(self, profile: ProfileView) -> None:
        self.profile = profile
        if profile.has_latency:
            self._worst_ttft = _ratio(profile.ttft_p99_ms, profile.ttft_p50_ms)
            self._worst_tpot = _ratio(profile.tpot_p99_ms, profile.tpot_p50_ms)

    def is_stale(self, now: float) -> bool:
        """The estimate rests on old points alone: no observation of our own for ``stale_after_s``
        and no recent requests in the engine's profile, so it may describe a load long gone."""
        profile = self.profile
        return (now - self.last_observed_at > self.stale_after_s
                and (profile is None or not profile.has_latency))

    def raw_estimate_ms(self, output_tokens: int, load: float, worst_case: bool, now: float) -> float | None:
        """Expected response time in ms for ``output_tokens`` tokens at ``load`` from the fits (or the
        profile), before calibration; None without data."""
        profile = self.profile
        own = self.ttft.count >= MIN_OBSERVATIONS
        if own and now - self.last_observed_at > self.stale_after_s and profile is not None and profile.has_latency:
            own = False  # the engine's recent window knows better than our old points
        if own:
            ttft, tpot = self.ttft.predict(load), self.tpot.predict(load)
            if worst_case:
                ttft *= self._worst_ttft
                tpot *= self._worst_tpot
        else:
            p = profile
            if p is None or not p.has_latency:
                return None
            ttft = p.ttft_p99_ms if worst_case else p.ttft_p50_ms
            tpot = p.tpot_p99_ms if worst_case else p.tpot_p50_ms
            if tpot <= 0.0 and p.tokens_per_second_per_stream > 0:
                tpot = 1000.0 / p.tokens_per_second_per_stream
        return ttft + max(output_tokens - 1, 0) * tpot

    def observe(self, load: float, ttft_ms: float, output_tokens: int, e2e_ms: float, now: float,
                raw_estimate_ms: float | None = None) -> None:
        """One finished request of this target, as the gateway timed it; ``raw_estimate_ms`` is what
        raw_estimate_ms said for it at dispatch (for its actual output), for the calibration."""
        self.last_observed_at = now
        if raw_estimate_ms is not None and raw_estimate_ms > 0 and e2e_ms > 0:
            self._ratios.append(e2e_ms / raw_estimate_ms)
            self._sorted_ratios = sorted(self._ratios)
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
