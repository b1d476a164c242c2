"""The live latency profile behind GetProfile: statistics over a sliding window of finished requests.

Fed by the scheduler loop's on_finished callback (and, in the gateway, by the streams it relays
from HTTP upstreams: routing/passive_profile.py); each finished request leaves one sample
(finish time, TTFT, decode time, output tokens, e2e). A query looks back ``window`` seconds
from now and computes:

- TTFT and TPOT p50/p99, where TPOT = decode_time / (completion_tokens - 1) (requests with
  at least two tokens). Percentiles interpolate linearly between the two nearest ranks
  (numpy's default), so p50 of an even count is the mean of the middle two.
- tokens/s per stream: the median over requests of (completion_tokens - 1) / decode_time,
  one request's decode speed after its first token.
- tokens/s total: completion tokens of the requests that finished within the window,
  divided by the time the window covers: the window, or, while the recorder is younger
  than the window, the time since it started (so a fresh server does not report a tenth of
  its real rate). Tokens of a request that started before the window count in full; over
  windows much longer than one request this is negligible.
- the largest completion_tokens among those requests.

Requests that produced no token (aborted or failed while waiting) leave no sample: they
have no TTFT. Samples older than ``retention_s`` (at least the default window) are dropped;
a query for a longer window is answered over the retention and says so in window_seconds.

Storage is a ring of ``capacity`` samples (DEFAULT_CAPACITY = 65,536, the scheduler's
``--profile-capacity``), five columns of doubles (40 bytes a sample, 2.5 MiB by default),
allocated and written once when the recorder is made: its pages are resident from the start
and the scheduler's resident memory does not grow with the number of samples later. (As
objects, samples cost ~180 bytes each, and a growing array's reallocations left the
allocators' high-water mark behind; at the stress suite's rate, 600 s of retention is some
75,000 samples.) When more requests finish within the asked window than the ring holds, the
oldest are overwritten: the answer then covers only the span since the newest overwritten
sample, and window_seconds says so (it is shorter than asked, as for the retention); the
rate divides by that span. Samples are in finish order (the clock is monotonic), so a query
finds its window's start by bisection and reads the columns as one or two slices.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError
from services.common.percentile import percentile, sorted_percentile


@dataclass(frozen=True, slots=True)
class FinishedSample:
    finish_time: float
    """Recorder clock when the request finished, seconds."""
    ttft_s: float
    decode_s: float
    """First output token to last."""
    completion_tokens: int
    e2e_s: float

    @property
    def tpot_s(self) -> float | None:
        return self.decode_s / (self.completion_tokens - 1) if self.completion_tokens > 1 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.completion_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.completion_tokens - 1) / self.decode_s


@dataclass(frozen=True, slots=True)
class LatencySnapshot:
    window_s: float
    num_requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    tokens_per_s_per_stream: float
    tokens_per_s_total: float
    max_output_tokens: int


DEFAULT_CAPACITY = 65_536
"""Samples the ring holds: 2.5 MiB. Over a 60 s window that is 1,092 finished requests a second."""


class _SampleRing:
    """The finished samples as five columns of a ring of ``capacity`` slots, in finish order;
    samples older than ``retention_s`` expire, and the oldest live ones are overwritten when full."""

    def __init__(self, capacity: int, retention_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.retention_s = retention_s
        # One column per field; the repeat writes every element, so the pages are touched now.
        zeros = array("d", [0.0]) * capacity
        self.finish, self.ttft, self.decode, self.tokens, self.e2e = (array("d", zeros) for _ in range(5))
        self.count = 0
        """Samples ever recorded: sample i sits in slot i % capacity until sample i + capacity overwrites it."""
        self.oldest = 0
        """The first sample neither expired by the retention nor overwritten."""
        self.lost_until = -math.inf
        """Finish time of the newest sample overwritten before it expired: windows reaching back
        past it are incomplete."""

    def append(self, finish: float, ttft: float, decode: float, tokens: int, e2e: float) -> None:
        self.expire(finish)
        slot = self.count % self.capacity
        if self.count - self.capacity >= self.oldest:  # the slot's sample is still live: it is lost
            self.lost_until = self.finish[slot]
            self.oldest = self.count - self.capacity + 1
        self.finish[slot], self.ttft[slot], self.decode[slot] = finish, ttft, decode
        self.tokens[slot], self.e2e[slot] = float(tokens), e2e
        self.count += 1

    def expire(self, now: float) -> None:
        horizon = now - self.retention_s
        finish, capacity = self.finish, self.capacity
        while self.oldest < self.count and finish[self.oldest % capacity] < horizon:
            self.oldest += 1

    def first_since(self, start: float) -> int:
        """The first live sample (absolute index) that finished at or after ``start``: bisection."""
        lo, hi, finish, capacity = self.oldest, self.count, self.finish, self.capacity
        while lo < hi:
            mid = (lo + hi) // 2
            if finish[mid % capacity] < start:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def column(self, column: array, first: int) -> array:
        """Samples first..newest of one column, in finish order (two slices when the ring wraps)."""
        begin, n = first % self.capacity, self.count - first
        if begin + n <= self.capacity:
            return column[begin:begin + n]
        return column[begin:] + column[:begin + n - self.capacity]


class LatencyProfileRecorder:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 retention_s: float | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.retention_s = max(window_s, retention_s if retention_s is not None else window_s)
        self.clock = clock
        self.started_at = clock()
        self._ring = _SampleRing(capacity, self.retention_s)

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    def __len__(self) -> int:
        return self._ring.count - self._ring.oldest

    @property
    def recorded(self) -> int:
        """Samples ever recorded (a snapshot taken at the same count and time would be equal)."""
        return self._ring.count

    # ------------------------------------------------------------------ feeding
    def record(self, sample: FinishedSample) -> None:
        self._ring.append(sample.finish_time, sample.ttft_s, sample.decode_s, sample.completion_tokens, sample.e2e_s)

    def on_finished(self, delta, output_state=None) -> None:
        """The scheduler loop's on_finished callback."""
        usage, timings = delta.usage, delta.timings
        if usage is None or timings is None or usage.completion_tokens == 0:
            return
        self._ring.append(self.clock(), timings.time_to_first_token_ms / 1000.0, timings.decode_time_ms / 1000.0,
                          usage.completion_tokens, timings.e2e_ms / 1000.0)

    # ------------------------------------------------------------------ reading
    def snapshot(self, window_s: float | None = None) -> LatencySnapshot:
        if window_s is None:
            window_s = self.window_s
        if not math.isfinite(window_s) or window_s <= 0:
            raise InvalidArgumentError(f"window_seconds must be a positive number, got {window_s}")
        window_s = min(window_s, self.retention_s)
        now, ring = self.clock(), self._ring
        ring.expire(now)
        start = now - window_s
        covered = min(window_s, now - self.started_at)
        if ring.lost_until >= start:  # the ring wrapped inside the window: say what it covers
            window_s = covered = now - ring.lost_until
        first = ring.first_since(start)
        return _summary(window_s, covered, ring.column(ring.ttft, first), ring.column(ring.tokens, first),
                        ring.column(ring.decode, first))


def _summary(window_s: float, covered: float, ttfts_s, tokens, decodes) -> LatencySnapshot:
    """The snapshot of one window's samples (columns in finish order), ``covered`` seconds of it observed."""
    ttfts = sorted(x * 1000.0 for x in ttfts_s)
    tpots, rates = [], []
    for n, decode in zip(tokens, decodes):
        if n > 1:
            tpots.append(decode * 1000.0 / (n - 1))
            if decode > 0:
                rates.append((n - 1) / decode)
    tpots.sort()
    rates.sort()
    return LatencySnapshot(
        window_s=window_s,
        num_requests=len(tokens),
        ttft_p50_ms=sorted_percentile(ttfts, 50),
        ttft_p99_ms=sorted_percentile(ttfts, 99),
        tpot_p50_ms=sorted_percentile(tpots, 50),
        tpot_p99_ms=sorted_percentile(tpots, 99),
        tokens_per_s_per_stream=sorted_percentile(rates, 50),
        tokens_per_s_total=sum(tokens) / covered if covered > 0 else 0.0,
        max_output_tokens=int(max(tokens, default=0)),
    )
