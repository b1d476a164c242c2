"""A target's latency profile as the gateway last read it (GetProfile), as plain values."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProfileView:
    read_at: float
    """Gateway clock when the answer arrived, seconds."""
    num_requests: int
    """Requests that finished within the profile's window (0 = no latency data)."""
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    tokens_per_second_per_stream: float
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    seeded: bool = False
    """The latency is a routes file's seed_profile, not a measurement (no request counted)."""

    @property
    def has_latency(self) -> bool:
        return (self.num_requests > 0 or self.seeded) and self.ttft_p50_ms > 0

    @property
    def load(self) -> int:
        """Requests on the engine when it answered: running plus waiting."""
        return self.num_running + self.num_waiting
