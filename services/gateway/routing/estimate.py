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
faster.

Until a target has ``MIN_OBSERVATIONS`` points of its own, its live profile stands in: TTFT and
TPOT medians (p99s for the worst case) measured by the engine over its recent window, at
whatever load it had. For the worst case a fitted value is scaled by the profile's p99/p50
ratio (``WORST_CASE_FALLBACK`` when the profile has no data).
"""

from __future__ import annotations

from services.gateway.routing.profile import ProfileView

DECAY = 0.97
"""Weight kept by a point per newer point (about the last 33 points count)."""
MIN_OBSERVATIONS = 3
WORST_CASE_FALLBACK = 2.0
MAX_WORST_CASE_RATIO = 10.0


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
        var_x = self._sxx / w - mean_x * mean_x
        slope = (self._sxy / w - mean_x * mean_y) / var_x if var_x > 1e-6 else 0.0
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

    __slots__ = ("ttft", "tpot", "profile", "last_observed_at", "stale_after_s", "_worst_ttft", "_worst_tpot")

    def __init__(self, stale_after_s: float = 30.0) -> None:
        self.ttft = DecayingLine()
        self.tpot = DecayingLine()
        self.profile: ProfileView | None = None
        self.last_observed_at = float("-inf")
        """Clock of the last observation."""
        self.stale_after_s = stale_after_s
        """Own observations older than this give way to a profile that has data."""
        self._worst_ttft = self._worst_tpot = WORST_CASE_FALLBACK

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

    def estimate_ms(self, output_tokens: int, load: float, worst_case: bool, now: float) -> float | None:
        """Expected response time in ms for ``output_tokens`` tokens at ``load``; None without data."""
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

    def observe(self, load: float, ttft_ms: float, output_tokens: int, e2e_ms: float, now: float) -> None:
        """One finished request of this target, as the gateway timed it."""
        self.last_observed_at = now
        self.ttft.add(load, ttft_ms)
        if output_tokens > 1:
            self.tpot.add(load, max(e2e_ms - ttft_ms, 0.0) / (output_tokens - 1))
        elif self.tpot.count == 0 and self.profile is not None and self.profile.tpot_p50_ms > 0:
            self.tpot.add(load, self.profile.tpot_p50_ms)


def _ratio(p99: float, p50: float) -> float:
    if p50 <= 0.0 or p99 <= 0.0:
        return WORST_CASE_FALLBACK
    return min(max(p99 / p50, 1.0), MAX_WORST_CASE_RATIO)
