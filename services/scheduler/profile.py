"""The live latency profile behind GetProfile: statistics over a sliding window of finished requests.

Fed by the scheduler loop's on_finished callback; each finished request leaves one sample
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

Samples are kept as rows of five doubles in one flat ``array('d')`` (40 bytes a sample), not as
objects (about 180 bytes each with their boxed floats): at the stress suite's rate of finished
requests, 600 s of retention is tens of thousands of samples, and as objects they made the
scheduler's resident memory grow by several MiB before the retention's plateau.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgumentError


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


_FIELDS = 5
_COMPACT_MIN_ROWS = 1024


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; 0 when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


class LatencyProfileRecorder:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 retention_s: float | None = None, max_samples: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.retention_s = max(window_s, retention_s if retention_s is not None else window_s)
        self.clock = clock
        self.started_at = clock()
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.max_samples = max_samples
        self._rows = array("d")
        """FinishedSample fields, _FIELDS doubles a row, in finish order (the clock is monotonic)."""
        self._head = 0
        """Index of the first live row: expired rows are skipped, then cut off in bulk."""

    def __len__(self) -> int:
        return len(self._rows) // _FIELDS - self._head

    # ------------------------------------------------------------------ feeding
    def record(self, sample: FinishedSample) -> None:
        self._rows.extend((sample.finish_time, sample.ttft_s, sample.decode_s, float(sample.completion_tokens),
                           sample.e2e_s))
        if len(self) > self.max_samples:
            self._head += 1
        self._expire(sample.finish_time)

    def on_finished(self, delta, output_state=None) -> None:
        """The scheduler loop's on_finished callback."""
        usage, timings = delta.usage, delta.timings
        if usage is None or timings is None or usage.completion_tokens == 0:
            return
        self.record(FinishedSample(
            finish_time=self.clock(), ttft_s=timings.time_to_first_token_ms / 1000.0,
            decode_s=timings.decode_time_ms / 1000.0, completion_tokens=usage.completion_tokens,
            e2e_s=timings.e2e_ms / 1000.0))

    def _expire(self, now: float) -> None:
        horizon = now - self.retention_s
        rows, end = self._rows, len(self._rows) // _FIELDS
        while self._head < end and rows[self._head * _FIELDS] < horizon:
            self._head += 1
        # Cut the dead rows once they are at least half of the array: amortized O(1) a sample.
        if self._head >= _COMPACT_MIN_ROWS and self._head * 2 >= end:
            del rows[:self._head * _FIELDS]
            self._head = 0

    def _samples_since(self, start: float) -> list[FinishedSample]:
        rows, out = self._rows, []
        for i in range(self._head * _FIELDS, len(rows), _FIELDS):
            if rows[i] >= start:
                out.append(FinishedSample(rows[i], rows[i + 1], rows[i + 2], int(rows[i + 3]), rows[i + 4]))
        return out

    # ------------------------------------------------------------------ reading
    def snapshot(self, window_s: float | None = None) -> LatencySnapshot:
        if window_s is None:
            window_s = self.window_s
        if not math.isfinite(window_s) or window_s <= 0:
            raise InvalidArgumentError(f"window_seconds must be a positive number, got {window_s}")
        window_s = min(window_s, self.retention_s)
        now = self.clock()
        self._expire(now)
        start = now - window_s
        samples = self._samples_since(start)
        ttfts = [s.ttft_s * 1000.0 for s in samples]
        tpots = [s.tpot_s * 1000.0 for s in samples if s.tpot_s is not None]
        rates = [r for s in samples if (r := s.decode_tokens_per_s) is not None]
        covered = min(window_s, now - self.started_at)
        tokens = sum(s.completion_tokens for s in samples)
        return LatencySnapshot(
            window_s=window_s,
            num_requests=len(samples),
            ttft_p50_ms=percentile(ttfts, 50),
            ttft_p99_ms=percentile(ttfts, 99),
            tpot_p50_ms=percentile(tpots, 50),
            tpot_p99_ms=percentile(tpots, 99),
            tokens_per_s_per_stream=percentile(rates, 50),
            tokens_per_s_total=tokens / covered if covered > 0 else 0.0,
            max_output_tokens=max((s.completion_tokens for s in samples), default=0),
        )

    def to_proto(self, window_s: float | None, stats):
        """GetProfile's answer: the window's statistics plus the scheduler's live gauges
        (``stats``: SchedulerStats, or None while no executor is connected)."""
        from services.common.pb.tokenmill.v1 import generation_pb2

        snap = self.snapshot(window_s)
        msg = generation_pb2.LatencyProfile(
            window_seconds=snap.window_s, num_requests=snap.num_requests,
            ttft_p50_ms=snap.ttft_p50_ms, ttft_p99_ms=snap.ttft_p99_ms,
            tpot_p50_ms=snap.tpot_p50_ms, tpot_p99_ms=snap.tpot_p99_ms,
            tokens_per_second_per_stream=snap.tokens_per_s_per_stream,
            tokens_per_second_total=snap.tokens_per_s_total,
            max_output_tokens=snap.max_output_tokens)
        if stats is not None:
            msg.kv_cache_usage = stats.kv_cache_usage
            msg.num_running = stats.num_running
            msg.num_waiting = stats.num_waiting
            spec = getattr(stats, "spec_decode", None)
            if spec is not None:
                msg.spec_mean_accepted_length = spec.mean_accepted_length
                msg.spec_acceptance_rate = spec.acceptance_rate
        return msg
