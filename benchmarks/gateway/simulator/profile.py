"""The simulator's GetProfile: percentiles over the finished requests of a recent window."""

from __future__ import annotations

import time
from collections import deque

from services.common.percentile import sorted_percentile
from benchmarks.gateway.simulator.engine import SimFinished

RETENTION_S = 600.0


class SimProfile:
    def __init__(self, window_s: float = 60.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.samples: deque[tuple[float, SimFinished]] = deque()

    def record(self, finished: SimFinished) -> None:
        now = self.clock()
        self.samples.append((now, finished))
        while self.samples and self.samples[0][0] < now - RETENTION_S:
            self.samples.popleft()

    def snapshot(self, window_s: float | None) -> dict:
        window = min(window_s or self.window_s, RETENTION_S)
        start = self.clock() - window
        recent = [f for at, f in self.samples if at >= start]
        ttfts = sorted(f.ttft_ms for f in recent)
        tpots = sorted(f.decode_ms / (f.completion_tokens - 1) for f in recent if f.completion_tokens > 1)
        rates = sorted((f.completion_tokens - 1) * 1000.0 / f.decode_ms for f in recent
                       if f.completion_tokens > 1 and f.decode_ms > 0)
        return {"window_seconds": window, "num_requests": len(recent), "ttft_p50_ms": sorted_percentile(ttfts, 50),
                "ttft_p99_ms": sorted_percentile(ttfts, 99), "tpot_p50_ms": sorted_percentile(tpots, 50),
                "tpot_p99_ms": sorted_percentile(tpots, 99), "tokens_per_second_per_stream": sorted_percentile(rates, 50),
                "tokens_per_second_total": sum(f.completion_tokens for f in recent) / window,
                "max_output_tokens": max((f.completion_tokens for f in recent), default=0)}
