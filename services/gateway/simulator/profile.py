"""The simulator's GetProfile: percentiles over the finished requests of a recent window."""

from __future__ import annotations

import math
import time
from collections import deque

from services.gateway.simulator.engine import SimFinished

RETENTION_S = 600.0


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


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
        return {"window_seconds": window, "num_requests": len(recent), "ttft_p50_ms": _percentile(ttfts, 50),
                "ttft_p99_ms": _percentile(ttfts, 99), "tpot_p50_ms": _percentile(tpots, 50),
                "tpot_p99_ms": _percentile(tpots, 99), "tokens_per_second_per_stream": _percentile(rates, 50),
                "tokens_per_second_total": sum(f.completion_tokens for f in recent) / window,
                "max_output_tokens": max((f.completion_tokens for f in recent), default=0)}
