"""The profile of a target that has no GetProfile (an HTTP upstream), measured from what it relays.

Every request the gateway relays from such a target and that finishes well leaves one sample: time
to first token, decode time (first token to last) and output tokens, as the gateway saw them. The
samples go into the same sliding-window recorder the engines keep behind GetProfile
(services/common/latency_profile.py), read over the same window (the gateway's
--profile-window-s), so an upstream's TTFT and TPOT p50/p99 and tokens/s per stream mean what an
engine's do. The in-flight count is the gateway's own (it is all the gateway knows of the
upstream's load), reported as running.

Until a sample exists within the window, a ``seed_profile`` from the routes file stands in (the
documents' MODEL_LATENCY_PROFILES shape: TTFT p50 and p99, tokens/s): TPOT is 1000 / tokens/s at
both percentiles (a seed says nothing about its spread). Without a seed the profile has no latency
data, and the latency strategy explores the target as it would a fresh engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.latency_profile import FinishedSample, LatencyProfileRecorder
from services.gateway.routes_file import SeedProfile
from services.gateway.routing.profile import ProfileView

CAPACITY = 4096
"""Samples kept per upstream (160 KiB): 400 finished requests a second over a 10 s window."""


class PassiveProfile:
    def __init__(self, window_s: float, seed: SeedProfile | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.seed = seed
        self.clock = clock
        self.recorder = LatencyProfileRecorder(window_s, clock=clock, capacity=CAPACITY)

    def observe(self, ttft_ms: float, e2e_ms: float, completion_tokens: int) -> None:
        """One request that finished well; ``completion_tokens`` 0 (nothing generated) says nothing."""
        if completion_tokens < 1:
            return
        self.recorder.record(FinishedSample(self.clock(), ttft_ms / 1000.0, max(e2e_ms - ttft_ms, 0.0) / 1000.0,
                                            completion_tokens, e2e_ms / 1000.0))

    def view(self, inflight: int) -> ProfileView:
        now = self.clock()
        snap = self.recorder.snapshot(self.window_s)
        if snap.num_requests == 0 and self.seed is not None:
            seed = self.seed
            tpot = 1000.0 / seed.tokens_per_second
            return ProfileView(now, 0, seed.ttft_p50_ms, seed.ttft_p99_ms, tpot, tpot, seed.tokens_per_second, 0.0,
                               inflight, 0, seeded=True)
        return ProfileView(now, snap.num_requests, snap.ttft_p50_ms, snap.ttft_p99_ms, snap.tpot_p50_ms,
                           snap.tpot_p99_ms, snap.tokens_per_s_per_stream, 0.0, inflight, 0)
